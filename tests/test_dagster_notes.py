"""A rematerialization whose settings differ from the run's says so in Dagster, as `conductor run` does on
stderr: a warning in the step's log and the asset's `notes` (they were only in the manifest)."""

import logging

import pytest
from dagster import DagsterInstance, materialize

from assets import resources
from tests.conftest import write_pool
from tests.test_dagster import ASSETS, add_partition, conductor_env, small_queries

pytestmark = pytest.mark.slow  # real Dagster materializations


def _budget(usd: float) -> dict:
    return {"ops": {"query_set": {"config": {"budget_usd": usd}}}}


def test_a_rerun_with_another_budget_logs_and_records_the_note(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 20))
        first = materialize(ASSETS, partition_key="small", instance=inst, resources=res, run_config=_budget(0.002),
                            raise_on_error=False)
        meta = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in first.get_asset_materialization_events()}
        assert "notes" not in meta["executions"]  # nothing differs from the run the first time
        stopped = meta["executions"]["statuses"].value["budget_exhausted"]

        rerun = materialize(ASSETS, partition_key="small", instance=inst, resources=res, run_config=_budget(1.0))
        meta = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in rerun.get_asset_materialization_events()}
        [note] = meta["executions"]["notes"].value
        assert "budget_usd 1 (was budget_usd 0.002)" in note and "--budget" not in note and f"the {stopped} plan(s) left to run" in note, note
        warnings = [e.user_message for e in inst.all_logs(rerun.run_id)
                    if e.level == logging.WARNING and "budget_usd 1 (was budget_usd 0.002)" in e.user_message]
        assert len(warnings) == 1 and f"run {meta['executions']['run_id'].value}: " in warnings[0], warnings
