"""The steps of a batch into one mirror, each module passed once on the way down (:mod:`.batch` runs them):
reduce the changes (:mod:`.reduce`), read what only the mirror knows (:mod:`.mirror_reads`), fold the newest rows
(:mod:`.fold`), then write and commit (:mod:`.row_delta`, or :mod:`.merge_writer`); the change log and the set-aside
changes (:mod:`.changelog`, :mod:`.rejects`) are committed before the mirror's own commit."""
