"""tests/engine has no __init__.py, so under pytest's prepend import mode the name `engine` could resolve to
this folder as a namespace package; put the repository first so it is always the real package."""
import sys
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[2])
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
if getattr(sys.modules.get("engine"), "__file__", "") is None:
    del sys.modules["engine"]
sys.path.insert(1, str(Path(__file__).parent))  # helpers.py

torch.set_num_threads(1)  # the machine is shared; tiny shapes gain nothing from more threads
