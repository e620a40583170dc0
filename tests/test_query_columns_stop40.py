"""A query set's other columns are carried into results.parquet: a file whose carried columns
would lose one of them, or could not be read back, is refused before anything is written or sent."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import cli, write_pool

IDS = ["q1", "q2", "q3"]


def _base() -> dict:
    return {"query_id": pa.array(IDS), "prompt": pa.array(["What is 2+3?", "What is 7*6?", "What is 10-4?"])}


def _latin1(values: list[bytes]) -> pa.Array:
    """Text with bytes that are not UTF-8, as Parquet can hold and pyarrow reads unchecked."""
    return pa.array(values, pa.binary()).view(pa.string())


def _refused(tmp_path, sim, columns: dict) -> str:
    """Run the query set; assert it is refused with nothing written or sent, and return the message."""
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table(columns), path)
    pool = write_pool(tmp_path / "pool.yaml", sim.url)
    data = tmp_path / "data"
    r = cli("run", path, "--pool", pool, "--data-dir", data)
    assert r.returncode == 2, r.stderr
    assert f"query set {path}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (data / "runs").exists()  # no run folder
    assert sim.log()["total"] == 0
    return r.stderr


@pytest.mark.parametrize("order", [("input_status", "status"), ("status", "input_status")])
def test_a_column_whose_input_name_is_taken_is_refused_naming_both(tmp_path, fresh_sim, order):
    cols = _base()
    cols[order[0]] = pa.array(["mine1", "mine2", "mine3"])
    cols[order[1]] = pa.array(["approved", "rejected", "approved"])
    err = _refused(tmp_path, fresh_sim, cols)
    assert "'input_status'" in err and "'status'" in err and "rename" in err, err


def test_invalid_utf8_in_a_carried_column_is_refused_naming_column_and_id(tmp_path, fresh_sim):
    cols = _base()
    cols["extra"] = _latin1([b"fine", b"caf\xe9 au lait", b"ok"])
    err = _refused(tmp_path, fresh_sim, cols)
    assert "column 'extra'" in err and "not valid UTF-8" in err and "row(s) 1" in err and "q2" in err, err
    assert "q1" not in err and "q3" not in err, err


def _nested(kind: str) -> pa.Array:
    bad = _latin1([b"ok", b"\xff\xfea", b"fine"])
    if kind == "large_string":
        return bad.cast(pa.binary()).cast(pa.large_binary()).view(pa.large_string())
    if kind == "list":
        return pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), bad)
    if kind == "struct":
        return pa.StructArray.from_arrays([bad], names=["note"])
    return pa.DictionaryArray.from_arrays(pa.array([0, 1, 2], pa.int32()), bad)


@pytest.mark.parametrize("kind", ["large_string", "list", "struct", "dictionary"])
def test_invalid_utf8_inside_other_column_types_is_refused(tmp_path, fresh_sim, kind):
    cols = _base()
    cols["notes"] = _nested(kind)
    err = _refused(tmp_path, fresh_sim, cols)
    assert "column 'notes'" in err and "not valid UTF-8 at row(s) 1 (query_id q2)" in err, err


def test_every_bad_column_is_named_in_one_message(tmp_path, fresh_sim):
    cols = _base()
    cols["prompt"] = _latin1([b"What is 2+3?", b"What is 7*6?", b"caf\xe9?"])
    cols["company"] = _latin1([b"\xffco", b"co2", b"co3"])
    err = _refused(tmp_path, fresh_sim, cols)
    assert "column 'prompt'" in err and "row(s) 2 (query_id q3)" in err, err
    assert "column 'company'" in err and "row(s) 0 (query_id q1)" in err, err
