import pickle

import pytest

from pgcdc.lsn import Lsn


@pytest.mark.parametrize(("text", "value"), [("0/0", 0), ("0/10", 16), ("16/B374D848", 0x16B374D848),
                                             ("FFFFFFFF/FFFFFFFF", 2**64 - 1)])
def test_parse_and_format_round_trip(text, value):
    lsn = Lsn.parse(text)
    assert lsn == value
    assert str(lsn) == text
    assert Lsn(str(lsn)) == lsn


@pytest.mark.parametrize("bad", ["", "16", "16/", "/1", "G/1", "1/2/3", "123456789/0"])
def test_parse_rejects_malformed_text(bad):
    with pytest.raises(ValueError, match="not an LSN"):
        Lsn.parse(bad)


def test_range_and_ordering_and_pickle():
    with pytest.raises(ValueError):
        Lsn(-1)
    with pytest.raises(ValueError):
        Lsn(2**64)
    assert Lsn("1/0") > Lsn("0/FFFFFFFF")
    restored = pickle.loads(pickle.dumps(Lsn("A/B")))
    assert isinstance(restored, Lsn) and str(restored) == "A/B"
