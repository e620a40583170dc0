"""Which executor runs a job's steps.

Locally every step of a run executes in the run's own process: the pipeline is
a chain, so separate step processes would only add start-up time. On Kubernetes
each step gets its own pod from dagster-k8s's `k8s_job_executor`, configured
by the YAML file that CONDUCTOR_K8S_EXECUTOR names (deploy/executor.k8s.yaml):
the planning step can then ask for GPUs and the execution step for network
and memory, independently."""

import os
from pathlib import Path
from typing import Mapping

import yaml
from dagster import ExecutorDefinition, in_process_executor

from conductor.errors import ConductorError


def executor_from_env(env: Mapping[str, str] = os.environ) -> ExecutorDefinition:
    path = env.get("CONDUCTOR_K8S_EXECUTOR")
    if not path:
        return in_process_executor
    return k8s_executor(Path(path))


def k8s_executor(path: Path) -> ExecutorDefinition:
    """`k8s_job_executor` configured from a YAML file, validated on load."""
    from dagster._config import process_config
    from dagster_k8s import k8s_job_executor

    if not path.exists():
        raise ConductorError(f"CONDUCTOR_K8S_EXECUTOR: {path}: file not found")
    config = yaml.safe_load(path.read_text()) or {}
    checked = process_config(k8s_job_executor.config_schema.as_field().config_type, config)
    if not checked.success:
        raise ConductorError(f"{path}: not a valid k8s_job_executor configuration: "
                             + "; ".join(e.message for e in checked.errors))
    return k8s_job_executor.configured(config, name="k8s_steps")
