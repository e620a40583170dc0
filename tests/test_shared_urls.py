"""The governor's and the shared cache's URLs and servers, as a user meets them: a cache
server that hangs or crawls, passwords that need percent-encoding, wrong passwords and
database numbers, malformed URLs, a cache setting that is not a Redis URL nor a usable
file, and a governor that was down for several runs. Real redis-server processes and
loopback listeners (on ports 9420-9449), the simulated provider over HTTP, real run folders."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tests.conftest import files_under, run_cli, write_pool
from tests.test_shared_governor import SlowLink, free_port, listen, start_redis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make setup-test installs Debian's)")


class Silent:
    """A loopback listener that accepts connections and never answers: a hung server."""

    def __init__(self):
        self.sock = listen()
        self.port = self.sock.getsockname()[1]
        self._held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self._held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()


@pytest.fixture
def redis_server():
    with start_redis() as server:
        yield server


def queries(tmp_path: Path, sample_queries: Path, n: int) -> Path:
    out = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, n), out)
    return out


def slow_pool(tmp_path: Path, sim, **provider) -> Path:
    """The `slow` worker (300 ms an answer, several in flight), with a short timeout_s: a run
    loop held up by the cache makes calls in flight run past it, and they are sent again."""
    return write_pool(tmp_path / "pool.yaml", sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 4, "timeout_s": 4, "max_attempts": 3, **provider}})


def run(tmp_path: Path, q: Path, pool: Path, env: dict, *extra: str, data: str = "data", timeout: float = 240):
    """`conductor run` from tmp_path (a relative cache path lands there, never in the repository)."""
    return run_cli("run", q, "--pool", pool, "--data-dir", tmp_path / data, "--quiet", *extra,
                   cwd=tmp_path, env=env, timeout=timeout)


def everything(r, folder: Path) -> str:
    """What the user can see: the command's output and every file of the data folder."""
    seen = [r.stdout, r.stderr]
    for p in files_under(folder):
        seen.append(str(pq.read_table(p).to_pylist()) if p.suffix == ".parquet" else
                    p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(seen)


def summary(folder: Path) -> dict:
    (path,) = folder.glob("runs/*/summary.json")
    return orjson.loads(path.read_bytes())


# ---- a cache server that hangs or crawls ----------------------------------------------


@pytest.fixture(params=["hung", "slow", "rediss-to-plain"])
def bad_cache(request, redis_server):
    """A cache URL whose server hangs, answers each round trip after a second, or is a plain
    Redis asked for TLS (which waits for a handshake that never comes)."""
    if request.param == "hung":
        server = Silent()
        yield f"redis://127.0.0.1:{server.port}/0", None
        server.close()
    elif request.param == "slow":
        link = SlowLink(redis_server.port, delay_s=1.0)
        yield link.url, link
        link.close()
    else:
        yield f"rediss://127.0.0.1:{redis_server.port}/0", None


def test_a_bad_cache_server_never_holds_the_run_nor_sends_a_call_twice(tmp_path, fresh_sim, sample_queries,
                                                                       bad_cache):
    """Each lookup on a hung cache held the run's loop 10 s: calls in flight ran past timeout_s and were
    sent, and paid, again (36 answers for 13 requests), some plans failed, and the run never ended."""
    url, link = bad_cache
    r = run(tmp_path, queries(tmp_path, sample_queries, 10), slow_pool(tmp_path, fresh_sim),
            {"CONDUCTOR_CACHE": url}, timeout=150)
    log = fresh_sim.log()
    # a slow cache is waited on a few times, then no more (before: on each lookup and each answer kept, 24+)
    assert link is None or link.held <= 12, f"the run waited on the slow cache {link.held} times"
    assert r.returncode == 0, r.stdout + r.stderr
    assert log["by_body"] and max(log["by_body"].values()) == 1, log["by_body"]  # no request sent twice
    assert summary(tmp_path / "data")["statuses"] == {"ok": 10}
    warned = [line for line in r.stderr.splitlines() if "shared cache" in line]
    assert len(warned) == 1 and "this run's own cache" in warned[0], r.stderr


def test_a_working_shared_cache_still_serves_another_machines_answers(tmp_path, fresh_sim, sample_queries,
                                                                      redis_server):
    """The guard beside the one above: a cache that answers in time is still used, and says nothing."""
    q, pool = queries(tmp_path, sample_queries, 8), slow_pool(tmp_path, fresh_sim)
    env = {"CONDUCTOR_CACHE": redis_server.url}
    first = run(tmp_path, q, pool, env, data="machine1")
    assert first.returncode == 0 and "shared cache" not in first.stderr, first.stderr
    sent = fresh_sim.log()["total"]
    second = run(tmp_path, q, pool, env, data="machine2")  # another data folder: only the shared cache has them
    assert second.returncode == 0, second.stderr
    assert sent > 0 and fresh_sim.log()["total"] == sent  # nothing sent again
    assert summary(tmp_path / "machine2")["statuses"] == {"ok": 8}


# ---- passwords that must be percent-encoded, and bare ones --------------------------------


def test_a_password_that_must_be_percent_encoded_is_refused_unshown(tmp_path, fresh_sim, sample_queries):
    """redis-py cut `p@ss#word` at the `#`, took `ss` for the host, and the error quoted it: the
    password's tail was printed and kept in summary.json, the journal and the traces."""
    server = start_redis(password="p@ss#word")
    try:
        q, pool = queries(tmp_path, sample_queries, 2), slow_pool(tmp_path, fresh_sim)
        raw = f"redis://:p@ss#word@127.0.0.1:{server.port}/0"
        r = run(tmp_path, q, pool, {"CONDUCTOR_GOVERNOR": raw})
        assert r.returncode == 2 and "CONDUCTOR_GOVERNOR" in r.stderr and "%40" in r.stderr, r.stderr
        assert f"redis://:***@127.0.0.1:{server.port}/0" in r.stderr, r.stderr
        assert "ss#word" not in everything(r, tmp_path / "data") and fresh_sim.log()["total"] == 0
        cache = run(tmp_path, q, pool, {"CONDUCTOR_CACHE": raw}, data="data2")
        assert cache.returncode == 2 and "CONDUCTOR_CACHE" in cache.stderr and "%23" in cache.stderr, cache.stderr
        assert "ss#word" not in everything(cache, tmp_path / "data2")
        encoded = run(tmp_path, q, pool, {"CONDUCTOR_GOVERNOR": f"redis://:p%40ss%23word@127.0.0.1:{server.port}/0"},
                      data="data3")
        assert encoded.returncode == 0, encoded.stderr  # as the message says to write it, it works
    finally:
        server.stop()


def test_a_password_written_where_the_user_name_goes_is_masked_everywhere(tmp_path, fresh_sim, sample_queries,
                                                                          redis_server):
    secret = "s3cretRedisPW"
    r = run(tmp_path, queries(tmp_path, sample_queries, 2), slow_pool(tmp_path, fresh_sim, max_attempts=1),
            {"CONDUCTOR_GOVERNOR": f"redis://{secret}@127.0.0.1:{redis_server.port}/0"})
    assert r.returncode != 0 and f"redis://***@127.0.0.1:{redis_server.port}/0" in r.stdout + r.stderr, r.stderr
    assert "s3cret" not in everything(r, tmp_path / "data") and "RedisPW" not in everything(r, tmp_path / "data")


def test_redact_url_masks_any_user_part_whatever_it_holds():
    from conductor.pool import redact_url

    assert redact_url("redis://:p@ss#word@127.0.0.1:9/0") == "redis://:***@127.0.0.1:9/0"
    assert redact_url("redis://:pa/ss?x@127.0.0.1:9/0") == "redis://:***@127.0.0.1:9/0"
    assert redact_url("redis://s3cretRedisPW@127.0.0.1:9/0") == "redis://***@127.0.0.1:9/0"
    assert redact_url("redis://127.0.0.1:9/0?password=ab#cd&db=1") == "redis://127.0.0.1:9/0?password=***&db=1"
    assert redact_url("redis://127.0.0.1:9/0?password=ab&cd&db=1") == "redis://127.0.0.1:9/0?password=***&db=1"
    assert redact_url("http://me:tok@127.0.0.1:9/v1?api_key=tok") == "http://me:***@127.0.0.1:9/v1?api_key=***"
    assert redact_url("redis:/:pw@127.0.0.1:9/0") == "redis:/:***@127.0.0.1:9/0"  # a `//` short


# ---- a governor down for several runs ----------------------------------------------------


def test_runs_made_while_the_governor_was_down_use_up_no_rerun(tmp_path, fresh_sim, sample_queries):
    """Four runs while Redis was down (nothing sent: "the call was not sent") used up the three
    reruns a failed call gets; once Redis was back, the rerun sent nothing and said "final"."""
    port = free_port()
    q, pool = queries(tmp_path, sample_queries, 3), slow_pool(tmp_path, fresh_sim, max_attempts=1)
    env = {"CONDUCTOR_GOVERNOR": f"redis://127.0.0.1:{port}/0"}
    args = ("--run-id", "down")
    for _ in range(4):
        down = run(tmp_path, q, pool, env, *args)
        assert down.returncode != 0 and "unreachable" in down.stdout + down.stderr, down.stdout + down.stderr
    assert fresh_sim.log()["total"] == 0
    from conductor.execute.shared.servers import RedisServer

    with RedisServer(port=port):
        back = run(tmp_path, q, pool, env, *args)
    assert back.returncode == 0, back.stdout + back.stderr
    assert summary(tmp_path / "data")["statuses"] == {"ok": 3}


# ---- checked before the run ------------------------------------------------------------------


def pool_with(governor: str | None = None):
    from conductor.pool import parse_pool
    from tests.conftest import worker

    doc = {"workers": [worker("fast", "http://127.0.0.1:9/v1")]}
    return parse_pool({**doc, "governor": governor} if governor else doc)


def test_a_wrong_password_or_database_is_a_configuration_error_before_any_call(monkeypatch):
    from conductor.execute.shared import SharedURLError, check_shared_urls

    server = start_redis(password="rightPW-7731")
    try:
        monkeypatch.setenv("CONDUCTOR_GOVERNOR", f"redis://:wrongPW-5513@127.0.0.1:{server.port}/0")
        with pytest.raises(SharedURLError) as e:
            check_shared_urls(pool_with())
        said = str(e.value)
        assert "CONDUCTOR_GOVERNOR" in said and "refused the password" in said and "nothing was called" in said
        assert f"redis://:***@127.0.0.1:{server.port}/0" in said and "PW-" not in said
        monkeypatch.delenv("CONDUCTOR_GOVERNOR")
        with pytest.raises(SharedURLError) as e:  # the pool file's governor, with a database the server lacks
            check_shared_urls(pool_with(f"redis://:rightPW-7731@127.0.0.1:{server.port}/99"))
        assert "`governor:`" in str(e.value) and "database number" in str(e.value) and "PW-" not in str(e.value)
        monkeypatch.setenv("CONDUCTOR_CACHE", f"redis://:wrongPW-5513@127.0.0.1:{server.port}/0")
        with pytest.raises(SharedURLError) as e:
            check_shared_urls(pool_with())
        assert "CONDUCTOR_CACHE" in str(e.value) and "refused the password" in str(e.value)
        check_shared_urls(pool_with(), cache=False)  # --no-cache: the cache's URL is not used
        monkeypatch.setenv("CONDUCTOR_CACHE", f"redis://:rightPW-7731@127.0.0.1:{server.port}/0")
        check_shared_urls(pool_with(f"redis://:rightPW-7731@127.0.0.1:{server.port}/1"))  # both right: no error
    finally:
        server.stop()


def test_a_hung_or_missing_governor_is_unreachable_before_any_call(monkeypatch):
    from conductor.execute.shared import GovernorDown, check_shared_urls

    hung = Silent()
    try:
        for url in (f"redis://127.0.0.1:{hung.port}/0", f"redis://127.0.0.1:{free_port()}/0"):
            monkeypatch.setenv("CONDUCTOR_GOVERNOR", url)
            with pytest.raises(GovernorDown) as e:
                check_shared_urls(pool_with())
            assert "unreachable" in str(e.value) and "nothing was called" in str(e.value), str(e.value)
    finally:
        hung.close()


def test_a_wrong_password_mid_run_says_refused_not_unreachable(tmp_path, fresh_sim, sample_queries):
    server = start_redis(password="rightPW-7731")
    try:
        r = run(tmp_path, queries(tmp_path, sample_queries, 2), slow_pool(tmp_path, fresh_sim),
                {"CONDUCTOR_GOVERNOR": f"redis://:wrongPW-5513@127.0.0.1:{server.port}/0"})
    finally:
        server.stop()
    shown = r.stdout + r.stderr
    assert r.returncode != 0 and "refused the password or user name" in shown and "unreachable" not in shown, shown
    assert fresh_sim.log()["total"] == 0 and "PW-" not in everything(r, tmp_path / "data")


# ---- malformed URLs ------------------------------------------------------------------------


@pytest.mark.parametrize("var, url, says", [
    ("CONDUCTOR_GOVERNOR", "redis://:pw-8812@127.0.0.1:notaport/0", "port"),
    ("CONDUCTOR_GOVERNOR", "redis://127.0.0.1:9/0?password=pw-8812&db=x", "'db'"),
    ("CONDUCTOR_GOVERNOR", "redis://127.0.0.1:9/zero", "database"),
    ("CONDUCTOR_GOVERNOR", "redis://127.0.0.1:99999/0", "port"),
    ("CONDUCTOR_GOVERNOR", "redis://:pw-8812@/0", "no host"),
    ("CONDUCTOR_CACHE", "redis://:pw-8812@127.0.0.1:bad/0", "port"),
    ("CONDUCTOR_CACHE", "redis://127.0.0.1:9/0?pasword=pw-8812", "query"),
])
def test_a_malformed_url_is_a_clear_error_naming_its_variable(tmp_path, sample_queries, fresh_sim, var, url, says):
    r = run(tmp_path, queries(tmp_path, sample_queries, 2), slow_pool(tmp_path, fresh_sim), {var: url})
    assert r.returncode == 2 and var in r.stderr and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "pw-8812" not in r.stdout + r.stderr
    assert fresh_sim.log()["total"] == 0


# ---- a cache setting that is neither a Redis URL nor a usable file ----------------------------


@pytest.mark.parametrize("value, says", [
    ("http://127.0.0.1:9", "is not a redis:// or rediss:// URL"),
    ("reddis://127.0.0.1:9/0", "is not a redis:// or rediss:// URL"),
    ("missing/dir/c.sqlite", "does not exist"),
    ("a-folder", "is a folder"),
])
def test_a_cache_setting_that_is_not_a_redis_url_nor_a_file_is_refused(tmp_path, sample_queries, fresh_sim,
                                                                        value, says):
    """http://... and reddis://... were taken for file names (./http:/127.0.0.1:9 created); a missing
    folder was created; a folder failed as a full disk (exit 5), naming another path."""
    (tmp_path / "a-folder").mkdir()
    q, pool = queries(tmp_path, sample_queries, 2), slow_pool(tmp_path, fresh_sim)
    before = set(tmp_path.iterdir())
    r = run(tmp_path, q, pool, {"CONDUCTOR_CACHE": value})
    assert r.returncode == 2 and "CONDUCTOR_CACHE" in r.stderr and says in r.stderr, r.stderr
    assert set(tmp_path.iterdir()) - before <= {tmp_path / "data"}  # no file or folder made from the value
    assert fresh_sim.log()["total"] == 0
