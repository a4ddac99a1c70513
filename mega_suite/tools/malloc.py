"""The process's memory allocator: tcmalloc, where installed, instead of glibc's malloc.

A training step on the CPU allocates and frees thousands of tensors. glibc's malloc keeps freed heap
resident (fragmentation between forward's temporaries and backward's) and returns large blocks to the kernel,
so the next step page-faults them in again; tcmalloc caches freed blocks per size class and hands memory
back gradually: a lower peak and no slower steps on the CPU, while jemalloc, which hands pages back to the
kernel eagerly, was slower (bench/reports/2026-11-24-tcmalloc.md; ``bench/small_models.py --malloc``).

An allocator can only be swapped before the process starts: ``run.py`` calls ``reexec`` first thing, which
restarts the same command line with the library in ``LD_PRELOAD`` (the process keeps its PID; what it
spawns, DataLoader workers and Lightning's rank processes, inherits the variable). The choice is the
environment variable ``MEGA_MALLOC``:

- ``auto`` (default): tcmalloc if a ``libtcmalloc_minimal.so.4`` / ``libtcmalloc.so.4`` is found (Debian /
  Ubuntu: ``apt-get install libtcmalloc-minimal4``) and ``LD_PRELOAD`` is empty (a preload of the user's,
  e.g. jemalloc or a sanitizer runtime, is left alone), glibc's malloc otherwise;
- ``tcmalloc`` / ``jemalloc``: that library, or an error naming where it was looked for;
- ``system``: no restart (an ``LD_PRELOAD`` inherited from the caller stays);
- a path to a shared library: that library.

Linux only (elsewhere nothing happens). torch's own launcher (``python -m torch.backends.xeon.run_cpu
--enable-tcmalloc``) does the same for CPU jobs through a wrapper process; here it is the default.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ENV = "MEGA_MALLOC"
MARK = "MEGA_MALLOC_PRELOADED"  # set in the restarted process: restart once, never loop
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
# tcmalloc reports every allocation over 1 GiB on stderr ("tcmalloc: large alloc ..."): a 7B model's
# weights and long-context activations are such allocations, not problems
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}


def search_dirs() -> list[Path]:
    """Where the libraries are looked for: the environment's own lib/ (a conda or venv install), then the
    system's library directories (multiarch first, as the dynamic linker orders them)."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    for root in ("/usr/local/lib", "/usr/lib", "/lib", "/usr/lib64", "/lib64"):
        if arch:
            dirs.append(Path(root) / arch)
        dirs.append(Path(root))
    return list(dict.fromkeys(dirs))


def find(name: str) -> Path | None:
    """The first file of ``LIBRARIES[name]`` in ``search_dirs()``, or None."""
    for d in search_dirs():
        for lib in LIBRARIES[name]:
            if (d / lib).is_file():
                return d / lib
    return None


def choose(setting: str | None) -> Path | None:
    """The library to preload for a ``MEGA_MALLOC`` value (None: ``auto``), or None for glibc's malloc.
    Raises ValueError naming the value and what was expected, or where a named library was looked for."""
    setting = (setting or "auto").strip()
    if setting in ("system", "glibc", ""):
        return None
    if setting == "auto":
        return find("tcmalloc")
    if setting in LIBRARIES:
        found = find(setting)
        if found is None:
            names = " / ".join(LIBRARIES[setting])
            where = ", ".join(str(d) for d in search_dirs())
            hint = " (Debian / Ubuntu: apt-get install libtcmalloc-minimal4)" if setting == "tcmalloc" else ""
            raise ValueError(
                f"{ENV}={setting}: no {names} in {where}{hint}; {ENV}=system uses glibc's malloc"
            )
        return found
    if "/" in setting:
        if Path(setting).is_file():
            return Path(setting)
        raise ValueError(f"{ENV}={setting!r}: no such file (expected the path of a shared library)")
    raise ValueError(
        f"{ENV}={setting!r}: expected auto, tcmalloc, jemalloc, system, or the path of a shared library"
    )


def restart_env(env: dict[str, str], lib: Path) -> dict[str, str]:
    """``env`` with ``lib`` first in LD_PRELOAD, the restart mark and tcmalloc's large-allocation reports
    off (unless the user set the threshold)."""
    out = dict(env)
    out["LD_PRELOAD"] = ":".join([str(lib), *filter(None, env.get("LD_PRELOAD", "").split(":"))])
    out[MARK] = str(lib)
    for key, value in QUIET.items():
        out.setdefault(key, value)
    return out


def loaded(lib: Path | str) -> bool | None:
    """Whether ``lib`` is mapped into this process (``/proc/self/maps`` names the file a symlink such as
    libtcmalloc_minimal.so.4 points to); None where /proc cannot be read."""
    names = (f"/{Path(lib).name}", f"/{Path(lib).resolve().name}")
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(names) for line in f)
    except OSError:
        return None


def restartable(script: str | None = None) -> bool:
    """Whether re-running ``sys.orig_argv`` repeats what is running now: not in an interactive session or
    a script read from stdin (consumed), nor where this code was started from inside another program
    (``runpy``, IPython's ``%run``: the command line is that program's). ``script``: the file that must be
    the one running (``sys.argv[0]``)."""
    argv, args = list(getattr(sys, "orig_argv", None) or []), sys.argv
    if sys.flags.interactive or hasattr(sys, "ps1") or not args or args[0] in ("", "-"):
        return False
    if script is not None and not (args[0] and Path(args[0]).resolve() == Path(script).resolve()):
        return False
    if len(argv) > len(args) and argv[-len(args) :] == args:  # python [options] script args
        return True
    flag = "-c" if args[0] == "-c" else "-m"  # python -c CODE args / -m MODULE args: argv[0] is not CODE
    return flag in argv and argv[argv.index(flag) + 2 :] == args[1:]


def reexec(script: str | None = None) -> str:
    """Restart this process with the chosen allocator preloaded (``os.execve``: no return) unless it is
    already loaded, this process is such a restart, ``auto`` finds ``LD_PRELOAD`` already set (the user's
    preload wins), the setting is ``system``, the command line cannot be re-run (``restartable``) or this
    is not Linux. ``script``: the entry script that must be running (``run.py`` passes its ``__file__``).
    Returns a one-line note for the log ("" when nothing was chosen). Call before anything else runs."""
    if not sys.platform.startswith("linux"):
        return ""
    setting = os.environ.get(ENV)
    lib = choose(setting)
    if lib is None:
        return ""
    is_loaded = loaded(lib)
    if is_loaded:
        return f"malloc: {lib.name} ({ENV}=system for glibc's malloc)"
    if os.environ.get(MARK) == str(lib):  # this process is the restart
        if is_loaded is None:
            return f"malloc: {lib.name} preloaded (not verified: no /proc/self/maps)"
        return f"malloc: {lib} could not be preloaded; glibc's malloc in use"
    preload = os.environ.get("LD_PRELOAD", "").strip()
    if (setting or "auto").strip() == "auto" and preload:
        return f"malloc: LD_PRELOAD is set ({preload}): left as it is, tcmalloc not added"
    if not restartable(script):
        return f"malloc: {lib.name} not preloaded (cannot restart this interpreter's command line)"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), restart_env(dict(os.environ), lib))
    raise AssertionError("unreachable")  # pragma: no cover
