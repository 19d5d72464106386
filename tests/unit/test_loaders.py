"""Whatever bytes a config file, a model.toml or a bundle tar holds, the loaders answer with a
table or one ``EdgerunError`` line naming the file, never a traceback (property tests), and a
bundle tar is unpacked into the cache, never beside the tar, leaving nothing when refused."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgerun.config import Config, load_config
from edgerun.errors import ConfigError, EdgerunError, ModelError
from edgerun.models.bundle import MANIFEST, load_bundle
from edgerun.tomlfile import MAX_TOML_BYTES, load_toml

# The profile (tests/conftest.py) picks the seed: fixed under `ci`, random under `make fuzz`, which also
# raises the example count past this floor.
PROPERTY = settings(
    max_examples=max(150, settings.default.max_examples),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Values TOML can carry, nested; keys drawn partly from the real schema so validation goes deep.
CONFIG_KEYS = st.sampled_from(
    [
        "node",
        "id",
        "log_level",
        "source",
        "kind",
        "uri",
        "fps",
        "replay",
        "seed",
        "model",
        "bundle",
        "engine",
        "order",
        "replicas",
        "pipeline",
        "queue_depth",
        "policy",
        "sinks",
        "mqtt",
        "dds",
        "jsonl",
        "port",
        "enabled",
        "service",
        "ota",
        "root_keys",
        "x",
        "",
    ]
)
MANIFEST_KEYS = st.sampled_from(
    [
        "name",
        "version",
        "task",
        "labels",
        "preprocess",
        "resize",
        "mean",
        "std",
        "pad_value",
        "decoder",
        "kind",
        "params",
        "variants",
        "tflite",
        "onnx",
        "provenance",
        "x",
        "",
    ]
)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.datetimes(),
    st.dates(),
    st.times(),
)


def toml_tables(keys: st.SearchStrategy[str]) -> st.SearchStrategy[dict]:
    values = st.recursive(
        SCALARS,
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys | st.text(max_size=8), kids, max_size=4),
        max_leaves=12,
    )
    return st.dictionaries(keys, values, max_size=6)


def _written(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@PROPERTY
@given(data=st.binary(max_size=400))
def test_any_bytes_as_a_config_file_are_a_config_or_one_config_error(tmp_path_factory, data):
    path = _written(tmp_path_factory.mktemp("cfg"), "node.toml", data)
    try:
        assert isinstance(load_config(path), Config)
    except ConfigError as err:
        assert str(err).startswith(str(path)) and "\n" not in str(err)


@PROPERTY
@given(table=toml_tables(CONFIG_KEYS))
@example(table={"node": {"\n": False}})  # found by a fresh clone's `make test`: an AssertionError traceback
@example(table={"node": {"a` - at `$.x\u2028é": [1]}, "": {'"': 0}})
def test_any_toml_as_a_config_file_is_a_config_or_one_config_error(tmp_path_factory, table):
    path = _written(tmp_path_factory.mktemp("cfg"), "node.toml", tomli_w.dumps(table).encode())
    try:
        assert isinstance(load_config(path), Config)
    except ConfigError as err:
        assert str(err).startswith(f"{path}: ") and str(err).isprintable()  # one line, the key path after the file


@pytest.fixture(scope="module")
def bundle_copy(tmp_path_factory, blazeface_bundle) -> Path:
    root = tmp_path_factory.mktemp("bundle") / "b"
    shutil.copytree(blazeface_bundle.root, root)
    return root


@PROPERTY
@given(data=st.binary(max_size=400))
def test_any_bytes_as_model_toml_are_a_model_error(bundle_copy, data):
    (bundle_copy / MANIFEST).write_bytes(data)
    with pytest.raises(ModelError) as info:  # never a valid manifest: name, decoder and variants are required
        load_bundle(bundle_copy)
    assert "\n" not in str(info.value)


@PROPERTY
@given(table=toml_tables(MANIFEST_KEYS))
def test_any_toml_as_model_toml_is_a_bundle_or_one_model_error(bundle_copy, table):
    (bundle_copy / MANIFEST).write_bytes(tomli_w.dumps(table).encode())
    try:
        load_bundle(bundle_copy)
    except ModelError as err:
        assert "\n" not in str(err)


@PROPERTY
@given(data=st.binary(max_size=2000), prefix=st.sampled_from([b"", b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"ustar"]))
def test_any_bytes_as_a_bundle_file_are_one_model_error_and_leave_nothing(tmp_path_factory, data, prefix):
    tmp = tmp_path_factory.mktemp("tar")
    archive = _written(tmp, "bundle.tar", prefix + data)
    with pytest.raises(ModelError) as info:
        load_bundle(archive, extract_dir=tmp / "cache")
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp.iterdir()) == ["bundle.tar", "cache"] or not (tmp / "cache").exists()
    assert not (tmp / "cache").exists() or not any((tmp / "cache").iterdir())


@PROPERTY
@given(members=st.lists(st.tuples(st.text(min_size=1, max_size=12), st.binary(max_size=64)), max_size=4))
def test_any_tar_of_junk_members_is_one_model_error_and_leaves_nothing(tmp_path_factory, members):
    tmp = tmp_path_factory.mktemp("tar")
    archive = tmp / "junk.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(EdgerunError) as info:
        load_bundle(archive, extract_dir=tmp / "cache")
    assert isinstance(info.value, ModelError) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe[node]\n", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b"a = " + b"[" * 5000, "invalid TOML (arrays or tables nested too deeply)"),
        (b"\x00\x01\x02binary", "invalid TOML"),
        (b"#" * (MAX_TOML_BYTES + 1), f"is larger than {MAX_TOML_BYTES} bytes"),
    ],
)
def test_bad_toml_files_name_the_file_and_the_fault(tmp_path, data, message):
    path = _written(tmp_path, "node.toml", data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


NOBODY = 65534


def _load_config_unprivileged(path: Path) -> str:
    """``load_config(path)`` as an unprivileged user: "ok", or the error it raised.

    Root reads any file whatever its mode, and the tests run as root, so there a forked child
    drops to nobody first (no groups) and reports back through a pipe.
    """
    if os.geteuid() != 0:
        try:
            load_config(path)
        except ConfigError as err:
            return str(err)
        return "ok"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                load_config(path)
                answer = "ok"
            except ConfigError as err:
                answer = str(err)
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_unreadable_and_directory_toml_files(tmp_path):
    with pytest.raises(ModelError, match=r"model\.toml is a directory, expected a file"):
        load_toml(tmp_path, ModelError, "model.toml")
    # A directory anyone may enter (pytest's own is root's alone), so only the file's mode stops the read.
    shared = Path(tempfile.mkdtemp(prefix="edgerun-perm-"))
    try:
        shared.chmod(0o755)
        readable = _written(shared, "readable.toml", b"")
        readable.chmod(0o644)
        locked = _written(shared, "locked.toml", b"")
        locked.chmod(0)
        assert _load_config_unprivileged(readable) == "ok"
        answer = _load_config_unprivileged(locked)
        assert answer.startswith(f"{locked}: ") and "cannot read config file" in answer, answer
    finally:
        shutil.rmtree(shared)


# -- where tars are unpacked -------------------------------------------------------------------------------


def _tar_of(bundle_root: Path, archive: Path, extra: tarfile.TarInfo | None = None) -> Path:
    with tarfile.open(archive, "w") as tar:
        tar.add(bundle_root, arcname="face")
        if extra is not None:
            tar.addfile(extra, io.BytesIO(b"x" * extra.size))
    return archive


def test_a_tar_is_unpacked_into_the_cache_not_beside_it(tmp_path, blazeface_bundle, monkeypatch):
    shelf = tmp_path / "etc-edgerun"  # read-only under ProtectSystem=strict on a real node
    shelf.mkdir()
    archive = _tar_of(blazeface_bundle.root, shelf / "face.tar")
    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    shelf.chmod(0o555)
    try:
        bundle = load_bundle(archive)
        again = load_bundle(archive)  # unpacked once, found by its hash
    finally:
        shelf.chmod(0o755)
    assert sorted(p.name for p in shelf.iterdir()) == ["face.tar"]
    assert bundle.root.is_relative_to(tmp_path / "cache" / "bundles")
    assert again.root == bundle.root
    assert [p.name for p in (tmp_path / "cache" / "bundles").iterdir()] == [bundle.root.parent.name]


def test_a_refused_tar_leaves_nothing_behind(tmp_path, blazeface_bundle):
    link = tarfile.TarInfo("face/evil")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    archive = _tar_of(blazeface_bundle.root, tmp_path / "face.tar", link)
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match="is a link or device"):
        load_bundle(archive, extract_dir=cache)
    assert list(cache.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "face.tar"]


def test_a_truncated_tar_is_one_model_error_and_leaves_nothing(tmp_path, blazeface_bundle):
    whole = _tar_of(blazeface_bundle.root, tmp_path / "whole.tar").read_bytes()
    archive = _written(tmp_path, "cut.tar", whole[: len(whole) // 2])
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match=r"cut\.tar: (damaged tar archive|no model\.toml|.*is missing)"):
        load_bundle(archive, extract_dir=cache)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_nodes_unpacking_one_tar_at_once_share_one_copy(tmp_path, blazeface_bundle):
    """Drones of one demo (or a restart racing a probe) load the same tar into the same cache."""
    import threading

    archive = _tar_of(blazeface_bundle.root, tmp_path / "face.tar")
    cache = tmp_path / "cache"
    start = threading.Barrier(4)
    roots: list[Path] = []
    errors: list[BaseException] = []

    def load() -> None:
        start.wait()
        try:
            roots.append(load_bundle(archive, extract_dir=cache).root)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(roots) == 4 and len(set(roots)) == 1
    assert [p.name for p in cache.iterdir()] == [roots[0].parent.name]  # no temporary directory left
