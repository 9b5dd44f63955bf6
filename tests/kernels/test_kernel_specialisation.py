"""Fewer compiles on a cold cache (issue 28): the integers that change with every batch (its size, its block-table
width, the decode split count and chunk) are not specialised, so Triton does not compile a variant for each value
of 1 and each multiple of 16 it meets. Read from the compiled (not interpreted) kernels, in a process of their own: this
folder's tests run in the interpreter, which keeps no specialisation."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import ROOT

READ = """
import json
from kvgate.kernels import decode_attention as d, prefill_attention as p
print(json.dumps({f.__name__: [a.name for a in f.params if a.do_not_specialize]
                  for f in (p._prefill_kernel, d._decode_split_kernel, d._decode_reduce_kernel)}))
"""


def test_batch_dependent_integers_are_not_specialised():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", READ], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "_prefill_kernel": ["stride_bt", "batch"],
        "_decode_split_kernel": ["stride_bt", "num_splits", "chunk"],
        "_decode_reduce_kernel": ["num_splits", "chunk"],
    }

