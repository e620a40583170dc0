"""Plans are written in parts as planning goes: a run stopped while planning (Ctrl-C, a
preempted GPU node) plans again only the queries it had not written, and a run begun when
parts were a fixed 50,000 queries resumes from the parts it wrote."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conductor import runner
from conductor.planparts import PART_SECONDS, SMALLEST_PART, next_size
from tests.conftest import SAMPLE, worker, write_pool


class StoppedAfter:
    """The run's own planner, stopped after `parts` parts as Ctrl-C would stop it."""

    def __init__(self, planner, parts: int | None = None):
        self.planner, self.parts, self.asked = planner, parts, []
        self.name = planner.name

    def plan(self, queries, pool, samples):
        if self.parts is not None and len(self.asked) == self.parts:
            raise KeyboardInterrupt
        self.asked.append((queries[0].index, queries[-1].index + 1))
        return self.planner.plan(queries, pool, samples)


def prepared(tmp_path, queries, data="data", chunk=20):
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9", workers=[worker("fast", "http://127.0.0.1:9"),
                                                                              worker("weak", "http://127.0.0.1:9")])
    cfg = runner.RunConfig(queries=queries, pool=pool, data_dir=tmp_path / data, plan_chunk=chunk, progress=False)
    return runner.prepare(cfg)


def plans(path):
    return pq.read_table(path).drop_columns(["run_id"]).to_pylist()


@pytest.fixture(scope="module")
def many_queries(tmp_path_factory):
    """2,500 queries: the sample set's, each asked under several ids."""
    t = pq.read_table(SAMPLE)
    copies = [t.set_column(0, "query_id", pc.binary_join_element_wise(t["query_id"], pa.scalar(f"-{i}"), ""))
              for i in range(7)]
    out = tmp_path_factory.mktemp("many") / "many.parquet"
    pq.write_table(pa.concat_tables(copies).slice(0, 2_500), out)
    return out


def test_a_run_stopped_while_planning_plans_only_what_it_had_not_written(tmp_path, many_queries):
    """Parts were 50,000 queries: a kill lost minutes of a GPU engine's planning."""
    clean = prepared(tmp_path, many_queries, "clean", chunk=50_000)
    whole = runner.plan_stage(clean)

    run = prepared(tmp_path, many_queries, chunk=50_000)
    stopped = StoppedAfter(runner.configured_planner(run.config), parts=1)
    with pytest.raises(KeyboardInterrupt):
        runner.plan_stage(run, stopped)
    assert stopped.asked == [(0, 1_000)]
    assert run.dir.read_manifest()["status"] == "interrupted"

    resumed = StoppedAfter(runner.configured_planner(run.config))
    out = runner.plan_stage(prepared(tmp_path, many_queries, chunk=50_000), resumed)
    assert resumed.asked[0][0] == 1_000 and resumed.asked[-1][1] == 2_500
    assert all(a[1] == b[0] for a, b in zip(resumed.asked, resumed.asked[1:]))
    assert plans(out) == plans(whole)


def test_a_run_planned_in_the_old_fixed_parts_resumes_from_them(tmp_path, sample_queries):
    """Parts were named part-00000.parquet, 50,000 queries each (`plan_chunk`)."""
    clean = prepared(tmp_path, sample_queries, "clean")
    whole = runner.plan_stage(clean)

    run = prepared(tmp_path, sample_queries)
    folder = run.dir.work / "plan_parts"
    planner = runner.configured_planner(run.config)
    runner.bind_planner(run, planner)
    for i in (0, 2):  # written by the old code, which was stopped while planning part 1
        runner._plan_part(run, planner, runner.planning_pool(run.pool), 20 * i, 20 * i + 20,
                          folder / f"part-{i:05d}.parquet")
    resumed = StoppedAfter(runner.configured_planner(run.config))
    out = runner.plan_stage(prepared(tmp_path, sample_queries), resumed)
    assert resumed.asked == [(20, 40)]
    assert plans(out) == plans(whole)


def test_parts_follow_the_planners_speed():
    """About PART_SECONDS of planning per part: a GPU engine's minutes are not all lost to a
    kill, and a fast planner does not write thousands of small files."""
    largest = 50_000
    assert next_size(1_000, 1_000, PART_SECONDS * 4, largest) == 250  # slow: smaller parts
    assert next_size(1_000, 1_000, 0.5, largest) == 2_000  # fast: at most doubling
    assert next_size(40_000, 40_000, 1.0, largest) == largest
    assert next_size(1_000, 1_000, 10_000.0, largest) == SMALLEST_PART
    assert next_size(1_000, 10, 0.01, largest) == 2_000  # a part cut short by one already written


@pytest.mark.parametrize("damage", ["empty file", "another run's part", "another --samples", "a repeated plan"])
def test_a_part_that_is_not_this_runs_is_set_aside_and_planned_again(tmp_path, sample_queries, damage):
    """Parts were trusted by their names: a 0-byte one ended the run in a pyarrow traceback, and
    one from another run (copied in, or fetched from a store) went into plans.parquet (audit48)."""
    import shutil

    clean = prepared(tmp_path, sample_queries, "clean")
    whole = runner.plan_stage(clean)

    def other(samples):
        run = runner.prepare(runner.RunConfig(queries=sample_queries, pool=clean.config.pool, plan_chunk=20,
                                              data_dir=tmp_path / f"other{samples}", progress=False,
                                              samples=samples, run_id=f"other{samples}"))
        runner.plan_stage(run)
        return run.dir.work / "plan_parts" / part.name

    run = prepared(tmp_path, sample_queries)
    with pytest.raises(KeyboardInterrupt):
        runner.plan_stage(run, StoppedAfter(runner.configured_planner(run.config), parts=2))
    part = run.dir.work / "plan_parts" / "part-0000000020-0000000040.parquet"
    if damage == "empty file":
        part.write_bytes(b"")
    elif damage == "a repeated plan":  # its own queries, one plan id twice (one plan would be lost)
        t = pq.read_table(part)
        ids = t["plan_id"].to_pylist()
        pq.write_table(t.set_column(t.schema.get_field_index("plan_id"), "plan_id", pa.array([ids[0], *ids[:-1]])),
                       part)
    else:
        shutil.copy(other(1 if damage == "another run's part" else 2), part)
    resumed = StoppedAfter(runner.configured_planner(run.config))
    out = runner.plan_stage(prepared(tmp_path, sample_queries), resumed)
    assert resumed.asked == [(20, 40), (40, 60)]
    assert plans(out) == plans(whole)
    assert (part.parent / f"{part.name}.set-aside").exists()
