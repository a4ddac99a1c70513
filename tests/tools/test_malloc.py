"""mega_suite.tools.malloc: which allocator run.py preloads, the restart, its loop guard and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_suite.tools import malloc

ROOT = Path(__file__).resolve().parents[2]
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")


def _mapped_library(stem: str) -> Path:
    """The file of a shared library this process has mapped (python always maps libc / libm)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if Path(path).name.startswith(stem) and ".so" in path:
                return Path(path)
    pytest.skip(f"no {stem}* mapped in this process")


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root with ``env`` on top of this environment (the
    restart marks of an outer run removed)."""
    base = {k: v for k, v in os.environ.items() if k not in (malloc.ENV, malloc.MARK, "LD_PRELOAD")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_choose_values(tmp_path, monkeypatch):
    monkeypatch.setattr(malloc, "search_dirs", lambda: [tmp_path])
    assert malloc.choose("system") is None
    assert malloc.choose("auto") is None  # nothing installed: glibc's malloc, no error
    assert malloc.choose(None) is None
    with pytest.raises(ValueError, match=r"MEGA_MALLOC=tcmalloc: no libtcmalloc_minimal\.so\.4.*apt-get"):
        malloc.choose("tcmalloc")
    with pytest.raises(ValueError, match=r"MEGA_MALLOC='tc-malloc': expected auto, tcmalloc"):
        malloc.choose("tc-malloc")
    with pytest.raises(ValueError, match=r"'/nope/lib\.so': no such file"):
        malloc.choose("/nope/lib.so")
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert malloc.choose("auto") == tmp_path / "libtcmalloc.so.4"
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build first (no heap profiler)
    assert malloc.choose("tcmalloc") == tmp_path / "libtcmalloc_minimal.so.4"
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert malloc.choose("jemalloc") == tmp_path / "libjemalloc.so.2"
    assert malloc.choose(str(tmp_path / "libjemalloc.so.2")) == tmp_path / "libjemalloc.so.2"


def test_restart_env_keeps_the_users_settings():
    env = {"LD_PRELOAD": "/a/liba.so:/b/libb.so", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "123", "X": "1"}
    out = malloc.restart_env(env, Path("/lib/libtcmalloc.so.4"))
    assert out["LD_PRELOAD"] == "/lib/libtcmalloc.so.4:/a/liba.so:/b/libb.so"
    assert out["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "123" and out["X"] == "1"
    assert out[malloc.MARK] == "/lib/libtcmalloc.so.4"
    assert env["LD_PRELOAD"] == "/a/liba.so:/b/libb.so"  # not modified in place
    fresh = malloc.restart_env({}, Path("/lib/libtcmalloc.so.4"))
    assert fresh["LD_PRELOAD"] == "/lib/libtcmalloc.so.4"
    assert int(fresh["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40


def test_package_import_does_not_import_torch():
    """run.py restarts the process before torch is imported (1.4 s): mega_suite's own import must not
    pull it in (its exports load on first use)."""
    proc = _python("import sys, mega_suite.tools.malloc; print('torch' in sys.modules)", {})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
    proc = _python(
        "import mega_suite; print(mega_suite.create_model.__module__, mega_suite.models.__name__)", {}
    )
    assert proc.stdout.split() == ["mega_suite.models.registry", "mega_suite.models"], proc.stderr[-2000:]


CHILD = (
    "import os, sys; from mega_suite.tools import malloc; note = malloc.reexec(); "
    "print(os.environ.get('LD_PRELOAD', ''), malloc.loaded(os.environ.get(malloc.ENV) or 'libc.so.6'), "
    "sep='|'); print(note)"
)


@LINUX
def test_reexec_preloads_and_restarts_once():
    """The restarted process has the library first in LD_PRELOAD, mapped, and says so; with
    ``system`` nothing changes."""
    other = _mapped_library("libc.")
    lib = next(
        (other.parent / n for n in ("libresolv.so.2", "libanl.so.1") if (other.parent / n).is_file()), None
    )
    if lib is None:  # a glibc library python does not map by itself: harmless to preload
        pytest.skip(f"no libresolv.so.2 / libanl.so.1 beside {other}")
    proc = _python(CHILD, {malloc.ENV: str(lib), "LD_PRELOAD": str(other)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, note = proc.stdout.strip().splitlines()
    assert first == f"{lib}:{other}|True"
    assert note == f"malloc: {lib.name} (MEGA_MALLOC=system for glibc's malloc)"
    proc = _python(CHILD, {malloc.ENV: "system"})
    assert proc.stdout.splitlines() == ["|False", ""], proc.stderr[-2000:]  # no LD_PRELOAD, no note


@LINUX
def test_reexec_gives_up_after_one_restart(tmp_path):
    """A file the dynamic linker refuses (it prints an error and runs on): one restart, then glibc."""
    bogus = tmp_path / "libnot.so"
    bogus.write_text("not an ELF file")
    proc = _python(CHILD, {malloc.ENV: str(bogus)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        proc.stdout.strip().splitlines()[-1]
        == f"malloc: {bogus} could not be preloaded; glibc's malloc in use"
    )


@LINUX
def test_tcmalloc_when_installed():
    lib = malloc.find("tcmalloc")
    if lib is None:
        pytest.skip("no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
    proc = _python(CHILD, {})  # auto
    assert proc.stdout.strip().splitlines()[-1].startswith(f"malloc: {lib.name}"), proc.stderr[-2000:]


@LINUX
def test_run_py_bad_setting_is_one_line():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "recipe=debug"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, malloc.ENV: "tc-malloc"}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: MEGA_MALLOC='tc-malloc': expected auto, tcmalloc, jemalloc, system, or the path of a shared "
        "library"
    ]


class _Exec(Exception):
    pass


@pytest.fixture
def fake_exec(monkeypatch, tmp_path):
    """reexec's decisions in this process: a fake library chosen, ``os.execve`` raising with its env."""
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(malloc, "search_dirs", lambda: [tmp_path])
    monkeypatch.setattr(sys, "platform", "linux")
    for key in (malloc.ENV, malloc.MARK, "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "run.py", "recipe=x"])
    monkeypatch.setattr(sys, "argv", ["run.py", "recipe=x"])

    def execve(path, argv, env):
        raise _Exec(argv, env)

    monkeypatch.setattr(os, "execve", execve)
    return lib


def test_reexec_decisions(fake_exec, monkeypatch):
    lib = fake_exec
    with pytest.raises(_Exec) as restart:  # auto, nothing preloaded: restart with the same command line
        malloc.reexec()
    argv, env = restart.value.args
    assert argv == ["python", "run.py", "recipe=x"] and env["LD_PRELOAD"] == str(lib)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so.2")  # the user's preload wins under auto
    assert (
        malloc.reexec()
        == "malloc: LD_PRELOAD is set (/opt/libjemalloc.so.2): left as it is, tcmalloc not added"
    )
    monkeypatch.setenv(malloc.ENV, "tcmalloc")  # ... but not over an explicit choice
    with pytest.raises(_Exec) as restart:
        malloc.reexec()
    assert restart.value.args[1]["LD_PRELOAD"] == f"{lib}:/opt/libjemalloc.so.2"
    monkeypatch.setenv(malloc.MARK, "/other/libjemalloc.so.2")  # a parent's restart for another library
    with pytest.raises(_Exec):
        malloc.reexec()
    monkeypatch.setenv(malloc.MARK, str(lib))  # this process is the restart, the library not mapped
    assert malloc.reexec() == f"malloc: {lib} could not be preloaded; glibc's malloc in use"
    monkeypatch.setattr(malloc, "loaded", lambda lib: None)  # no /proc
    assert malloc.reexec() == "malloc: libtcmalloc_minimal.so.4 preloaded (not verified: no /proc/self/maps)"
    monkeypatch.setattr(malloc, "loaded", lambda lib: True)
    assert malloc.reexec() == "malloc: libtcmalloc_minimal.so.4 (MEGA_MALLOC=system for glibc's malloc)"
    monkeypatch.setenv(malloc.ENV, "system")
    assert malloc.reexec() == ""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv(malloc.ENV, "tcmalloc")
    assert malloc.reexec() == ""


@pytest.mark.parametrize(
    ("orig", "argv", "script", "ok"),
    [
        (["python", "run.py", "a=1"], ["run.py", "a=1"], "run.py", True),
        (["python", "-X", "utf8", "/r/run.py"], ["/r/run.py"], "/r/run.py", True),
        (["python", "-m", "pdb", "run.py", "a=1"], ["run.py", "a=1"], "run.py", True),
        (["python", "-c", "code", "a"], ["-c", "a"], None, True),
        (["python", "-m", "bench.x", "a"], ["/r/bench/x.py", "a"], None, True),
        (["python", "nb.py"], ["run.py"], "run.py", False),  # runpy.run_path from another script
        (["python", "nb.py"], ["nb.py"], "run.py", False),  # argv kept: the running file is not the script
        (["python", "-"], ["-"], None, False),  # stdin, consumed
        (["python"], [""], None, False),  # interactive
    ],
)
def test_restartable(monkeypatch, orig, argv, script, ok):
    monkeypatch.setattr(sys, "orig_argv", orig)
    monkeypatch.setattr(sys, "argv", argv)
    assert malloc.restartable(script) is ok


def test_reexec_refuses_a_command_line_it_cannot_repeat(fake_exec, monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "nb.py"])
    assert malloc.reexec("run.py").endswith("not preloaded (cannot restart this interpreter's command line)")
