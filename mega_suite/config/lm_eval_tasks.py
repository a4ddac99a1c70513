"""lm-evaluation-harness task names, checked without torch (``make_plan`` refuses a misspelt task at once).

The harness learns its task names by indexing thousands of YAML files (about 15 s on a 2-core CPU), so the
names are cached per lm-eval version in the user's cache folder; a local ``include_path`` is indexed each time
(it is the user's, and small).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata
import json
import os
from pathlib import Path

from mega_suite.errors import ConfigError


@functools.lru_cache(maxsize=4)
def manager(include_path: str | None, defaults: bool):
    """The harness's TaskManager over ``include_path`` and, with ``defaults``, its own tasks."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _cache_file() -> Path:
    try:
        version = importlib.metadata.version("lm_eval")  # the package's metadata: no import of the harness
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mega_suite"
    return cache / f"lm_eval_tasks-{version}.json"


def harness_task_names() -> list[str]:
    """Every task, group and tag name the harness's own index knows (cached, see the module's note)."""
    file = _cache_file()
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        pass
    names = sorted(manager(None, True).all_tasks)
    with contextlib.suppress(OSError):  # a read-only home only costs the next run the indexing
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(names))
        os.replace(tmp, file)
    return names


def check_task_names(names: list[str], include_path: str | None) -> None:
    """Every name is a task of ``include_path`` or of the harness (or a task YAML file); an unknown one is a
    ConfigError with the nearest known names."""
    if include_path and not Path(include_path).is_dir():
        raise ConfigError(f"lm_eval.include_path={include_path} is not a folder of task YAMLs")
    local = list(manager(str(Path(include_path).resolve()), False).all_tasks) if include_path else []
    unknown = [n for n in names if n not in local and not Path(n).is_file()]
    if not unknown:
        return
    known = harness_task_names()
    unknown = [n for n in unknown if n not in known]
    if unknown:
        near = {n: difflib.get_close_matches(n, local + known, n=3) for n in unknown}
        where = (
            f", {include_path} {len(local)}" if include_path else "; local tasks go in lm_eval.include_path"
        )
        raise ConfigError(
            f"lm_eval.tasks: unknown task(s) {unknown}; nearest: {near} (the harness knows {len(known)} names"
            f"{where})"
        )
