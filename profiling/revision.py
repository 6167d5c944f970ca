"""Another revision's ghostdp, loaded beside this checkout's: the --against option of profiling.step_ratio and
profiling.overhead, which run its modes in the same rounds as this checkout's."""
from __future__ import annotations

import atexit
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile


def ghostdp_at(revision: str):
    """The ghostdp package of git revision ``revision`` of the repository holding this checkout, imported as
    its own package (ghostdp's modules import each other relatively, so a copy under another name is whole)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{revision}^{{commit}}"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.strip()
        archive = subprocess.run(["git", "archive", commit, "ghostdp"], cwd=root, capture_output=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        detail = detail.decode() if isinstance(detail, bytes) else detail
        raise SystemExit(f"--against {revision}: cannot read ghostdp at that revision from the git repository in "
                         f"{root} ({detail.strip() or error}); give a commit, tag or branch of this "
                         "repository") from None
    name = f"ghostdp_at_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    folder = tempfile.mkdtemp(prefix="ghostdp-against-")
    atexit.register(shutil.rmtree, folder, True)  # kept to the end: its modules may import others lazily
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    for path, _, files in os.walk(os.path.join(folder, "ghostdp")):
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(path, file), encoding="utf-8") as f:
                    if re.search(r"^\s*(from|import) ghostdp\b", f.read(), re.MULTILINE):
                        shutil.rmtree(folder)
                        raise SystemExit(f"--against {revision}: its ghostdp imports itself by name "
                                         f"({os.path.relpath(os.path.join(path, file), folder)}), so it cannot be "
                                         "loaded beside this checkout's")
    os.rename(os.path.join(folder, "ghostdp"), os.path.join(folder, name))
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
