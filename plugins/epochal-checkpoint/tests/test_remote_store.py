"""Checkpoints on an fsspec URL: ``memory://`` unit tests of the store, and the CLI against S3.

The S3 tests start moto's S3 server on 127.0.0.1 (a free port) in this process, behind a gate
that can hold one upload request: a run is killed with SIGKILL while the request is held, and
the request then fails without being stored, as an upload cut by a kill does. They are skipped,
saying why, when moto or s3fs is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import Checkpoint, CorruptCheckpointError, Load
from epochal_checkpoint.storage import MANIFEST, POINTER, store
from epochal_checkpoint.storage.store import UPLOAD, RemoteStore
from epochal_checkpoint.testing import TORTURE_CONFIG, make_data, make_model

from epochal import ConfigError, Loop
from epochal.testing import epochal_command

FIRST, SECOND, THIRD = "ckpt-e0001-i000016", "ckpt-e0002-i000032", "ckpt-e0003-i000048"


# -- memory:// ------------------------------------------------------------------------------------


def memory_url() -> str:
    return f"memory://epochal-tests/{uuid.uuid4().hex}"


def run(url: str, tmp_path: Path, epochs: int, resume: bool | str = False, **options: Any) -> Loop:
    plugin = Checkpoint(dir=url, **options)
    loop = Loop(
        make_model(1000),
        make_data(),
        plugins={"checkpoint": plugin},
        seed=0,
        run_dir=tmp_path / "run",
        handle_signals=False,
        max_epochs=epochs,
        resume=resume,
    )
    loop.run()
    return loop


def arrays(loop: Loop) -> dict[str, bytes]:
    state = loop.model.state_dict()
    return {k: np.asarray(v).tobytes() for k, v in state.items() if isinstance(v, np.ndarray)}


def test_memory_store_commits_each_checkpoint_and_resumes_bitwise(tmp_path: Path) -> None:
    straight = run(memory_url(), tmp_path / "a", epochs=3)
    url = memory_url()
    run(url, tmp_path / "b", epochs=2, keep_last=None)
    remote = RemoteStore(url)
    infos, ignored = remote.checkpoints()
    assert [i.name for i in infos] == [FIRST, SECOND] and ignored == []
    assert remote.read_pointer() == SECOND
    for name in (FIRST, SECOND):  # every file the manifest lists is in the store, beside the manifest
        listed = {k.rsplit("/", 1)[1] for k in remote.fs.find(remote._key(name))}
        assert {MANIFEST, UPLOAD, *infos[0 if name == FIRST else 1].manifest["files"]} == listed
    resumed = run(url, tmp_path / "b", epochs=3, resume=True, keep_last=None)
    assert resumed.resumed and resumed.resumed_source == f"checkpoint {url}/{SECOND}"
    assert arrays(resumed) == arrays(straight)
    assert repr(list(resumed.log.rows())) == repr(list(straight.log.rows()))
    assert [i.name for i in remote.checkpoints()[0]] == [FIRST, SECOND, THIRD]


@pytest.mark.filterwarnings("ignore:epochal-checkpoint. a epoch save:RuntimeWarning")  # async: deferred
@pytest.mark.parametrize("variant", ["async_save", "signed", "export"])
def test_async_signed_and_exported_saves_go_to_the_store(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    variants: dict[str, dict[str, Any]] = {
        "async_save": {"async_save": True},
        "signed": {},
        "export": {"export": "both", "monitor": "valid.loss"},
    }
    options = variants[variant]
    if variant == "signed":
        monkeypatch.setenv("EPOCHAL_CHECKPOINT_KEY", "a key for the tests")
    url = memory_url()
    run(url, tmp_path, epochs=2, **options)
    remote = RemoteStore(url)
    assert [i.name for i in remote.checkpoints()[0]] == [FIRST, SECOND]
    if variant == "signed":
        assert all(remote.fs.exists(remote._key(name, "signature.json")) for name in (FIRST, SECOND))
    if variant == "export":
        assert remote.fs.exists(remote._key("best.safetensors"))
        assert remote.fs.exists(remote._key("last.safetensors"))
    resumed = run(url, tmp_path, epochs=3, resume=True, **options)
    assert resumed.resumed_source == f"checkpoint {url}/{SECOND}" and resumed.iteration == 48
    assert [i.name for i in remote.checkpoints()[0]] == [FIRST, SECOND, THIRD]


def test_best_k_on_the_store_and_export_best_from_its_url(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from epochal_checkpoint.commands import export_command
    from safetensors.numpy import load_file

    url = memory_url()  # valid.loss falls epoch after epoch: with mode = "max" the first is best
    run(url, tmp_path, epochs=3, keep_last=1, keep_best=1, monitor="valid.loss", mode="max")
    remote = RemoteStore(url)
    assert remote.names() == [FIRST, THIRD]
    first = remote.read(FIRST).state["model"]
    result = CliRunner().invoke(export_command, [url, "--best", "-o", str(tmp_path / "best.safetensors")])
    assert result.exit_code == 0, result.output
    assert f"checkpoint {url}/{FIRST} (epoch 1, iteration 16, best valid.loss=" in result.output
    exported = load_file(tmp_path / "best.safetensors")
    assert {k: v.tobytes() for k, v in exported.items()} == {k: first[k].tobytes() for k in exported}


def test_resume_path_and_load_take_a_url(tmp_path: Path) -> None:
    url, other = memory_url(), memory_url()
    run(url, tmp_path / "a", epochs=2)
    resumed = run(other, tmp_path / "b", epochs=3, resume=f"{url}/{FIRST}")
    assert resumed.resumed_source == f"checkpoint {url}/{FIRST}" and resumed.iteration == 48
    assert [i.name for i in RemoteStore(other).checkpoints()[0]] == [SECOND, THIRD]
    for path, shown in ((url, SECOND), (f"{url}/{POINTER}", SECOND), (f"{url}/{FIRST}/{MANIFEST}", FIRST)):
        load = Load(path=path)
        loop = Loop(
            make_model(1000),
            make_data(),
            plugins={"load": load},
            seed=0,
            handle_signals=False,
            max_epochs=3,
        )
        loop.run()
        assert (
            loop.resumed_source == f"checkpoint {url}/{shown}"
            and store.shown(load.loaded) == f"{url}/{shown}"
        )


def test_a_fresh_run_into_a_store_with_checkpoints_is_refused_and_latest_is_its_url(tmp_path: Path) -> None:
    url = memory_url()
    plugin = Checkpoint(dir=url)
    assert plugin.check_fresh_run(None, ["epochal", "run", "run.toml"]) is None
    assert plugin.latest_checkpoint(None) is None
    run(url, tmp_path, epochs=2)
    refusal = plugin.check_fresh_run(None, ["epochal", "run", "run.toml"])
    assert refusal is not None and f"'{url}' already holds 2 checkpoint(s)" in refusal
    assert "epochal run run.toml --resume" in refusal
    assert plugin.latest_checkpoint(None) == f"{url}/{SECOND}"


def test_a_checkpoint_without_its_manifest_never_reads_as_complete(tmp_path: Path) -> None:
    url = memory_url()
    run(url, tmp_path, epochs=2, keep_last=None)
    remote = RemoteStore(url)
    remote.fs.rm_file(remote._key(SECOND, MANIFEST))  # as an upload killed before its commit
    infos, ignored = remote.checkpoints()
    assert [i.name for i in infos] == [FIRST] and ignored == [] and remote.uncommitted == [SECOND]
    read, failures = remote.find_latest()
    assert read.manifest["name"] == FIRST and failures == []


def test_a_damaged_object_is_refused_before_download_naming_the_url(tmp_path: Path) -> None:
    url = memory_url()
    run(url, tmp_path, epochs=2, keep_last=None)
    remote = RemoteStore(url)
    data = remote.fs.cat_file(remote._key(SECOND, "data.bin"))
    remote.fs.pipe_file(remote._key(SECOND, "data.bin"), data + b"x" * 10)
    too_long = rf"{url}/{SECOND}'.*data.bin has {len(data) + 10} bytes"
    with pytest.raises(CorruptCheckpointError, match=too_long):
        remote.read(SECOND)
    with pytest.warns(RuntimeWarning, match="trying the previous checkpoint"):
        read, failures = remote.find_latest()
    assert read.manifest["name"] == FIRST and [p.name for p, _ in failures] == [SECOND]


def test_retention_deletes_the_manifest_first_and_the_marker_last(tmp_path: Path) -> None:
    url = memory_url()
    run(url, tmp_path, epochs=3, keep_last=1)
    remote = RemoteStore(url)
    assert remote.names() == [THIRD] and [i.name for i in remote.checkpoints()[0]] == [THIRD]
    removed: list[str] = []
    fs = remote.fs
    rm_file, rm = fs.rm_file, fs.rm

    def recorded_rm_file(path: str, **kwargs: Any) -> Any:
        removed.append(str(path))
        return rm_file(path, **kwargs)

    def recorded_rm(paths: Any, *args: Any, **kwargs: Any) -> Any:
        removed.extend(map(str, paths if isinstance(paths, list) else []))
        return rm(paths, *args, **kwargs)

    try:
        fs.rm_file, fs.rm = recorded_rm_file, recorded_rm
        remote.delete(THIRD)
    finally:
        del fs.rm_file, fs.rm
    names = [k.rsplit("/", 1)[1] for k in removed]
    assert names[0] == MANIFEST and names[-1] == UPLOAD and "data.bin" in names
    assert remote.names() == []


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_leftovers_of_a_dead_process_of_this_host_are_cleaned(tmp_path: Path) -> None:
    url = memory_url()
    remote = RemoteStore(url)
    marks = {
        "ckpt-e0001-i000001": {"host": socket.gethostname(), "pid": dead_pid()},
        "ckpt-e0001-i000002": {"host": "another-host", "pid": dead_pid()},
        "ckpt-e0001-i000003": {"host": socket.gethostname(), "pid": os.getppid()},  # alive
    }
    for name, mark in marks.items():
        remote.fs.pipe_file(remote._key(name, UPLOAD), json.dumps(mark).encode())
        remote.fs.pipe_file(remote._key(name, "data.bin"), b"partial")
    remote.fs.pipe_file(remote._key("ckpt-e0001-i000004", "data.bin"), b"no marker")
    assert remote.checkpoints() == ([], [])
    with pytest.warns(RuntimeWarning) as warned:
        assert remote.clean_leftovers() == ["ckpt-e0001-i000001"]
    assert remote.names() == ["ckpt-e0001-i000002", "ckpt-e0001-i000003", "ckpt-e0001-i000004"]
    text = "\n".join(str(w.message) for w in warned)
    assert "another-host" in text and "no upload marker" in text and "left in place" in text


def test_staging_directories_of_dead_processes_of_this_host_are_removed() -> None:
    import tempfile

    temp = Path(tempfile.gettempdir())
    dead = temp / f"{store.STAGING}{store._host_tag()}-{dead_pid()}-test"
    alive = temp / f"{store.STAGING}{store._host_tag()}-{os.getppid()}-test"
    other = temp / f"{store.STAGING}another-host-{dead_pid()}-test"
    for folder in (dead, alive, other):
        (folder / FIRST).mkdir(parents=True, exist_ok=True)
    try:
        remote = RemoteStore(memory_url())
        assert remote.staging.name.startswith(f"{store.STAGING}{store._host_tag()}-{os.getpid()}-")
        assert not dead.exists() and alive.exists() and other.exists()
        remote.close()
    finally:
        for folder in (dead, alive, other):
            shutil.rmtree(folder, ignore_errors=True)


def test_a_missing_backend_names_the_pip_package() -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed: no backend is missing")
    with pytest.raises(ConfigError, match=r"'gs://bucket/run'.*gcsfs"):
        RemoteStore("gs://bucket/run")


def test_file_urls_and_paths_stay_local() -> None:
    assert not any(store.is_remote(where) for where in ("file:///tmp/x", "runs/x", None))
    assert store.is_remote("s3://b/p") and store.is_remote("memory://x")
    assert store.local_path("file:///tmp/x") == Path("/tmp/x")


# -- S3 (moto's server on 127.0.0.1) through the CLI ----------------------------------------------

KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Gate:
    """Holds a PUT whose path ends with :attr:`suffix` (after letting :attr:`skip` such pass),
    then fails it unstored."""

    def __init__(self) -> None:
        self.suffix: str | None = None
        self.skip = 0
        self.held = threading.Event()
        self.release = threading.Event()

    def wrap(self, app: Callable[..., Any]) -> Callable[..., Any]:
        def gated(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            path = environ.get("PATH_INFO", "")
            if self.suffix and environ.get("REQUEST_METHOD") == "PUT" and path.endswith(self.suffix):
                if self.skip:
                    self.skip -= 1
                    return app(environ, start_response)
                self.suffix = None
                self.held.set()
                self.release.wait(60)
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            return app(environ, start_response)

        return gated


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 with bucket ``bucket``: the endpoint, env and a gate."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'epochal-checkpoint[s3]')")
    server_module = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    gate = Gate()

    class GatedServer(server_module.ThreadedMotoServer):  # type: ignore[name-defined]
        def _server_entry(self) -> None:
            app = server_module.DomainDispatcherApplication(server_module.create_backend_app)
            self._server = make_server(
                self._ip_address,
                self._port,
                gate.wrap(app),
                True,
                request_handler=server_module.MotoRequestHandler,
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = GatedServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import fsspec

    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    # moto keeps its buckets process-wide: another test's server may have made this one already
    fsspec.filesystem("s3", **options).makedirs("bucket", exist_ok=True)
    env = {**KEYS, "AWS_ENDPOINT_URL": endpoint}
    yield {"endpoint": endpoint, "env": env, "gate": gate, "options": options}
    gate.release.set()
    server.stop()


def config(tmp_path: Path, url: str, extra: str = "", keep_last: int = 2) -> Path:
    text = TORTURE_CONFIG.format(size=1000, every=0, async_save="false")
    text = text.replace("keep_last = 2", f"keep_last = {keep_last}")
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run.toml").write_text(f'{text}dir = "{url}"\n{extra}')
    return tmp_path


def cli(s3: dict[str, Any], where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return epochal_command("run", "run.toml", *args, cwd=where, env=s3["env"])


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def final_state(s3: dict[str, Any], url: str) -> tuple[dict[str, bytes], str]:
    read, _ = RemoteStore(url, s3["options"]).find_latest()
    state = read.state
    model = {k: np.asarray(v).tobytes() for k, v in state["model"].items() if isinstance(v, np.ndarray)}
    return model, repr(state["log"]["rows"])  # the status differs: run ids


@pytest.fixture(scope="module")
def straight(s3: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A straight 3-epoch run saving to the store (keep_last = 2): its URL and final state."""
    url = f"s3://bucket/{uuid.uuid4().hex}"
    where = config(tmp_path_factory.mktemp("straight"), url)
    done = cli(s3, where, "--set", "loop.max_epochs=3")
    assert done.returncode == 0, done.stderr
    return {"url": url, "state": final_state(s3, url)}


@pytest.mark.slow
def test_s3_run_saves_prunes_and_resumes_bitwise(
    s3: dict[str, Any], straight: dict[str, Any], tmp_path: Path
) -> None:
    remote = RemoteStore(straight["url"], s3["options"])
    assert remote.names() == [SECOND, THIRD]  # keep_last = 2: the first pruned, nothing of it left
    assert [i.name for i in remote.checkpoints()[0]] == [SECOND, THIRD] and remote.read_pointer() == THIRD

    url = f"s3://bucket/{uuid.uuid4().hex}"
    where = config(tmp_path, url)
    first = cli(s3, where, "--set", "loop.max_epochs=2")
    assert first.returncode == 0, first.stderr
    assert f"checkpoints: {url}" in first.stdout + first.stderr
    resumed = cli(s3, where, "--resume", "--set", "loop.max_epochs=3")
    assert resumed.returncode == 0, resumed.stderr
    assert final_state(s3, url) == straight["state"]

    exported = epochal_command("export", url, "-o", "w.safetensors", cwd=tmp_path, env=s3["env"])
    assert exported.returncode == 0, exported.stderr
    assert f"checkpoint {url}/{THIRD}" in exported.stdout
    from safetensors.numpy import load_file

    assert {k: v.tobytes() for k, v in load_file(tmp_path / "w.safetensors").items()} == straight["state"][0]


@pytest.mark.slow
@pytest.mark.parametrize("held", ["data.bin", MANIFEST, POINTER])
def test_kill_9_during_an_upload_leaves_nothing_complete_and_resume_auto_continues(
    held: str, s3: dict[str, Any], straight: dict[str, Any], tmp_path: Path
) -> None:
    url = f"s3://bucket/{uuid.uuid4().hex}"
    where = config(tmp_path, url)
    gate: Gate = s3["gate"]
    gate.held.clear()
    gate.release.clear()
    # latest: the second checkpoint's (the first passes), after its manifest: it is committed
    gate.suffix, gate.skip = (f"/{POINTER}", 1) if held == POINTER else (f"/{SECOND}/{held}", 0)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    child = subprocess.Popen(
        [sys.executable, "-m", "epochal", "run", "run.toml", "--set", "loop.max_epochs=3"],
        cwd=where,
        env={**environ, **s3["env"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert gate.held.wait(120), "the upload of the second checkpoint never came"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        gate.release.set()
        child.kill()
    assert child.returncode == -signal.SIGKILL

    remote = RemoteStore(url, s3["options"])
    infos, ignored = remote.checkpoints()
    committed = [FIRST, SECOND] if held == POINTER else [FIRST]
    assert [i.name for i in infos] == committed and ignored == [] and remote.read_pointer() == FIRST
    assert remote.uncommitted == ([] if held == POINTER else [SECOND])

    resumed = cli(s3, where, "--resume", "auto", "--set", "loop.max_epochs=3")
    assert resumed.returncode == 0, resumed.stderr
    assert f"checkpoint {url}/{committed[-1]}" in resumed.stdout + resumed.stderr  # not latest's
    assert final_state(s3, url) == straight["state"]
    # the leftover was cleaned (of a dead process of this host), so the name was free again
    assert [i.name for i in remote.checkpoints()[0]] == [SECOND, THIRD] and remote.uncommitted == []


def open_uploads(fs: Any, key: str) -> list[str]:
    """The incomplete multipart uploads (their keys) under *key* (``bucket/prefix``), as S3 lists them."""
    bucket, _, prefix = key.partition("/")
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
    return [upload["Key"] for upload in listed.get("Uploads", [])]


def test_the_open_multipart_uploads_of_a_dead_writer_are_aborted_at_the_next_start(
    s3: dict[str, Any],
) -> None:
    """Issue 44, item 5: a kill -9 during an upload left its parts in the store (billed); a later
    start aborts them where the upload marker proves the writer dead, and leaves a live one's."""
    remote = RemoteStore(f"s3://bucket/{uuid.uuid4().hex}", s3["options"])
    dead, live = "ckpt-e0001-i000001", "ckpt-e0001-i000002"
    for name, pid in ((dead, dead_pid()), (live, os.getppid())):
        mark = {"host": socket.gethostname(), "pid": pid}
        remote.fs.pipe_file(remote._key(name, UPLOAD), json.dumps(mark).encode())
        bucket, _, key = remote._key(name, "data.bin").partition("/")
        started = remote.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        part = {"PartNumber": 1, "Body": b"x" * (5 << 20), "UploadId": started["UploadId"]}
        remote.fs.call_s3("upload_part", Bucket=bucket, Key=key, **part)
    assert open_uploads(remote.fs, remote._key(dead)) == [remote._key(dead, "data.bin").partition("/")[2]]
    assert remote.checkpoints() == ([], [])
    with pytest.warns(RuntimeWarning, match="AbortIncompleteMultipartUpload"):  # the live one's
        assert remote.clean_leftovers() == [dead]
    assert open_uploads(remote.fs, remote._key(dead)) == []
    assert len(open_uploads(remote.fs, remote._key(live))) == 1
    assert remote.names() == [live]


@pytest.mark.slow
def test_a_missing_bucket_is_one_line_before_training_and_nothing_is_written(
    s3: dict[str, Any], tmp_path: Path
) -> None:
    import fsspec

    where = config(tmp_path, "s3://no-such-bucket/run")
    line = one_error_line(cli(s3, where))
    assert "'s3://no-such-bucket/run'" in line and "bucket does not exist" in line
    assert not fsspec.filesystem("s3", **s3["options"]).exists("no-such-bucket")


@pytest.mark.slow
def test_an_unreachable_endpoint_from_storage_options_is_one_line(s3: dict[str, Any], tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"s3://bucket/{uuid.uuid4().hex}"
    extra = f'\n[plugins.checkpoint.storage_options]\nendpoint_url = "http://127.0.0.1:{port}"\n'
    line = one_error_line(cli(s3, config(tmp_path, url, extra)))
    assert f"'{url}'" in line and f"127.0.0.1:{port}" in line
    assert RemoteStore(url, s3["options"]).names() == []


@pytest.mark.slow
def test_a_url_whose_backend_is_missing_is_one_line_naming_the_package(
    s3: dict[str, Any], tmp_path: Path
) -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed: no backend is missing")
    line = one_error_line(cli(s3, config(tmp_path, "gs://bucket/run")))
    assert "'gs://bucket/run'" in line and "gcsfs" in line


@pytest.mark.slow
def test_credentials_the_store_refuses_are_one_line_before_training(
    s3: dict[str, Any], tmp_path: Path
) -> None:
    """moto's server with authentication on (a second one, in its own process): unknown keys."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert server.poll() is None and time.monotonic() < deadline, "moto's server did not start"
            time.sleep(0.1)
        env = {**s3["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        result = epochal_command("run", "run.toml", cwd=config(tmp_path, "s3://bucket/run"), env=env)
        line = one_error_line(result)
        assert "'s3://bucket/run'" in line and "PermissionError" in line and "Access Key Id" in line
        assert not list(tmp_path.glob("run/**/ckpt-*"))
    finally:
        server.terminate()
        server.wait(30)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_sharded_checkpoint_from_a_store_is_read_from_the_store_on_several_machines() -> None:
    """Rank 0's verified copy is in its staging directory, on its machine only: on several
    machines every rank reads the DCP files from the checkpoint's URL, with the store's options."""
    from types import SimpleNamespace

    from epochal_checkpoint.sharded import read_from_store

    remote = RemoteStore(f"memory://epochal-tests/{uuid.uuid4().hex}")
    try:
        staged = str(remote.staging / "ckpt-e0001-i000008")
        options = {"endpoint_url": "http://127.0.0.1:9"}
        for nodes, expected in ((1, {"dcp": staged}), (2, {"dcp": remote.where("ckpt-e0001-i000008")})):
            state: dict[str, Any] = {"model": {"dcp": staged}}
            read_from_store(SimpleNamespace(several_nodes=nodes > 1), state, options)
            storage = {"dcp_storage": options} if nodes > 1 else {}
            assert state["model"] == {**expected, **storage}
        local = {"model": {"dcp": "/shared/checkpoints/ckpt-e0001-i000008"}}  # a shared filesystem
        read_from_store(SimpleNamespace(several_nodes=True), local, options)
        assert local["model"] == {"dcp": "/shared/checkpoints/ckpt-e0001-i000008"}
    finally:
        remote.close()
