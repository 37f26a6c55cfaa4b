// Test code only: an Iceberg REST catalog server for pgcdc's test suite, not a part of pgcdc.
//
// No REST catalog server can be installed on the test machines, so the suite compiles this file with javac and
// runs it. It serves Iceberg's REST protocol over HTTP (the JDK's com.sun.net.httpserver) and leaves every
// catalog decision to Iceberg's own org.apache.iceberg.rest.CatalogHandlers over a JDBC catalog, as Iceberg's
// own REST test fixture does. It sits in Iceberg's package to use the package-private RESTObjectMapper: the
// same JSON (de)serializers the REST client uses.
//
// Usage: java -cp <iceberg runtime, Spark's jars, s3a jars, JDBC driver, classes> \
//            org.apache.iceberg.rest.RestCatalogServer <catalog.properties>
// The properties file holds the JDBC catalog's properties (uri, jdbc.user, warehouse, io-impl, ...), Hadoop
// settings as hadoop.<key>, and optionally required-token (a Bearer token every request must carry). The
// server listens on 127.0.0.1 on a free port and prints "listening on <port>" once it serves.
package org.apache.iceberg.rest;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.Executors;
import org.apache.hadoop.conf.Configuration;
import org.apache.iceberg.catalog.Namespace;
import org.apache.iceberg.catalog.TableIdentifier;
import org.apache.iceberg.exceptions.AlreadyExistsException;
import org.apache.iceberg.exceptions.CommitFailedException;
import org.apache.iceberg.exceptions.CommitStateUnknownException;
import org.apache.iceberg.exceptions.NamespaceNotEmptyException;
import org.apache.iceberg.exceptions.NoSuchNamespaceException;
import org.apache.iceberg.exceptions.NoSuchTableException;
import org.apache.iceberg.exceptions.NoSuchViewException;
import org.apache.iceberg.exceptions.NotAuthorizedException;
import org.apache.iceberg.exceptions.ValidationException;
import org.apache.iceberg.jdbc.JdbcCatalog;
import org.apache.iceberg.rest.requests.CreateNamespaceRequest;
import org.apache.iceberg.rest.requests.CreateTableRequest;
import org.apache.iceberg.rest.requests.RegisterTableRequest;
import org.apache.iceberg.rest.requests.RenameTableRequest;
import org.apache.iceberg.rest.requests.UpdateNamespacePropertiesRequest;
import org.apache.iceberg.rest.requests.UpdateTableRequest;
import org.apache.iceberg.rest.responses.ConfigResponse;
import org.apache.iceberg.rest.responses.ErrorResponse;
import org.apache.iceberg.shaded.com.fasterxml.jackson.databind.ObjectMapper;

public final class RestCatalogServer {
  private static final ObjectMapper MAPPER = RESTObjectMapper.mapper();

  private final JdbcCatalog catalog;
  private final String requiredToken;

  private RestCatalogServer(JdbcCatalog catalog, String requiredToken) {
    this.catalog = catalog;
    this.requiredToken = requiredToken;
  }

  public static void main(String[] args) throws Exception {
    Properties file = new Properties();
    try (InputStream in = new FileInputStream(args[0])) {
      file.load(in);
    }
    Configuration hadoop = new Configuration();
    Map<String, String> properties = new HashMap<>();
    for (String key : file.stringPropertyNames()) {
      if (key.startsWith("hadoop.")) {
        hadoop.set(key.substring("hadoop.".length()), file.getProperty(key));
      } else if (!key.equals("required-token")) {
        properties.put(key, file.getProperty(key));
      }
    }
    JdbcCatalog catalog = new JdbcCatalog();
    catalog.setConf(hadoop);
    catalog.initialize("rest_backend", properties);
    RestCatalogServer server = new RestCatalogServer(catalog, file.getProperty("required-token"));
    HttpServer http = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 64);
    http.createContext("/", server::handle);
    http.setExecutor(Executors.newFixedThreadPool(8));
    http.start();
    System.out.println("listening on " + http.getAddress().getPort());
    System.out.flush();
    // ends with its parent: the test closes stdin (or the parent dies) and the server stops
    while (System.in.read() >= 0) {
      // nothing to read
    }
    http.stop(0);
    System.exit(0);
  }

  private void handle(HttpExchange exchange) throws IOException {
    try {
      if (requiredToken != null
          && !("Bearer " + requiredToken).equals(exchange.getRequestHeaders().getFirst("Authorization"))) {
        throw new NotAuthorizedException("Not authorized: a valid bearer token is required");
      }
      Object response = route(exchange);
      if (response == null) {
        send(exchange, 204, null);
      } else {
        send(exchange, 200, MAPPER.writeValueAsBytes(response));
      }
    } catch (Exception e) {
      int code = status(e);
      ErrorResponse error =
          ErrorResponse.builder()
              .responseCode(code)
              .withType(e.getClass().getSimpleName())
              .withMessage(String.valueOf(e.getMessage()))
              .build();
      send(exchange, code, "HEAD".equals(exchange.getRequestMethod()) ? null : MAPPER.writeValueAsBytes(error));
    }
  }

  private static int status(Exception e) {
    if (e instanceof NotAuthorizedException) {
      return 401;
    }
    if (e instanceof NoSuchNamespaceException || e instanceof NoSuchTableException
        || e instanceof NoSuchViewException || e instanceof NoRoute) {
      return 404;
    }
    if (e instanceof AlreadyExistsException || e instanceof CommitFailedException
        || e instanceof NamespaceNotEmptyException) {
      return 409;
    }
    if (e instanceof IllegalArgumentException || e instanceof ValidationException
        || e instanceof UnsupportedOperationException) {
      return 400;
    }
    if (e instanceof CommitStateUnknownException) {
      return 500;
    }
    return 500;
  }

  private static final class NoRoute extends RuntimeException {
    NoRoute(String what) {
      super("no route for " + what);
    }
  }

  private Object route(HttpExchange exchange) throws IOException {
    String method = exchange.getRequestMethod();
    String[] parts = exchange.getRequestURI().getRawPath().replaceAll("^/+|/+$", "").split("/");
    Map<String, String> query = query(exchange.getRequestURI().getRawQuery());
    if (parts.length < 2 || !parts[0].equals("v1")) {
      throw new NoRoute(method + " " + exchange.getRequestURI());
    }
    if (parts.length == 2 && parts[1].equals("config")) {
      return ConfigResponse.builder().build();
    }
    if (parts.length == 3 && parts[1].equals("tables") && parts[2].equals("rename") && method.equals("POST")) {
      CatalogHandlers.renameTable(catalog, read(exchange, RenameTableRequest.class));
      return null;
    }
    if (!parts[1].equals("namespaces")) {
      throw new NoRoute(method + " " + exchange.getRequestURI());
    }
    if (parts.length == 2) {
      if (method.equals("GET")) {
        Namespace parent =
            query.containsKey("parent") ? RESTUtil.decodeNamespace(query.get("parent")) : Namespace.empty();
        return CatalogHandlers.listNamespaces(catalog, parent);
      }
      return CatalogHandlers.createNamespace(catalog, read(exchange, CreateNamespaceRequest.class));
    }
    Namespace namespace = RESTUtil.decodeNamespace(parts[2]);
    if (parts.length == 3) {
      switch (method) {
        case "GET":
          return CatalogHandlers.loadNamespace(catalog, namespace);
        case "HEAD":
          CatalogHandlers.namespaceExists(catalog, namespace);
          return null;
        case "DELETE":
          CatalogHandlers.dropNamespace(catalog, namespace);
          return null;
        default:
          throw new NoRoute(method + " " + exchange.getRequestURI());
      }
    }
    if (parts.length == 4 && parts[3].equals("properties")) {
      return CatalogHandlers.updateNamespaceProperties(
          catalog, namespace, read(exchange, UpdateNamespacePropertiesRequest.class));
    }
    if (parts.length == 4 && parts[3].equals("register")) {
      return CatalogHandlers.registerTable(catalog, namespace, read(exchange, RegisterTableRequest.class));
    }
    if (parts.length == 4 && parts[3].equals("tables")) {
      if (method.equals("GET")) {
        return CatalogHandlers.listTables(catalog, namespace);
      }
      CreateTableRequest request = read(exchange, CreateTableRequest.class);
      return request.stageCreate()
          ? CatalogHandlers.stageTableCreate(catalog, namespace, request)
          : CatalogHandlers.createTable(catalog, namespace, request);
    }
    if (parts.length >= 5 && parts[3].equals("tables")) {
      TableIdentifier table = TableIdentifier.of(namespace, RESTUtil.decodeString(parts[4]));
      if (parts.length == 6 && parts[5].equals("metrics")) {
        exchange.getRequestBody().readAllBytes(); // scan reports: accepted and not kept
        return null;
      }
      if (parts.length == 5) {
        switch (method) {
          case "GET":
            return CatalogHandlers.loadTable(catalog, table);
          case "HEAD":
            CatalogHandlers.tableExists(catalog, table);
            return null;
          case "POST":
            return CatalogHandlers.updateTable(catalog, table, read(exchange, UpdateTableRequest.class));
          case "DELETE":
            if ("true".equals(query.get("purgeRequested"))) {
              CatalogHandlers.purgeTable(catalog, table);
            } else {
              CatalogHandlers.dropTable(catalog, table);
            }
            return null;
          default:
            break;
        }
      }
    }
    throw new NoRoute(method + " " + exchange.getRequestURI());
  }

  private static Map<String, String> query(String raw) {
    Map<String, String> values = new HashMap<>();
    if (raw != null) {
      for (String pair : raw.split("&")) {
        int eq = pair.indexOf('=');
        if (eq > 0) {
          // namespaces stay encoded: RESTUtil.decodeNamespace splits them at the encoded separator
          String key = URLDecoder.decode(pair.substring(0, eq), StandardCharsets.UTF_8);
          values.put(key, pair.substring(eq + 1));
        }
      }
    }
    return values;
  }

  private static <T> T read(HttpExchange exchange, Class<T> type) throws IOException {
    return MAPPER.readValue(exchange.getRequestBody().readAllBytes(), type);
  }

  private static void send(HttpExchange exchange, int code, byte[] body) throws IOException {
    if (body == null) {
      exchange.sendResponseHeaders(code, -1);
    } else {
      exchange.getResponseHeaders().set("Content-Type", "application/json");
      exchange.sendResponseHeaders(code, body.length);
      try (OutputStream out = exchange.getResponseBody()) {
        out.write(body);
      }
    }
    exchange.close();
  }
}
