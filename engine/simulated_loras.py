"""The simulated engine's LoRA adapters: what LoraSlots needs of a device (`read`, `load`) without weights, so fleet
tests and benchmarks exercise slots, loads, evictions and admission fast. `read` checks what a real read checks first
(the PEFT folder has an adapter_config.json, LoraError naming the file otherwise) and costs `read_s`, as reading an
adapter's safetensors from disk does (a worker reads on a thread of its own: worker/adapter_reads.py); `load` costs
`load_s`, as copying an adapter from host memory into a device slot does, inside the step. Both are slept when the
runner sleeps. Torch-free."""
from __future__ import annotations

import time
from pathlib import Path

from kvgate.engine.lora import LoraError


class SimulatedLoras:
    def __init__(self, load_s: float = 0.0, sleep: bool = True, read_s: float = 0.0) -> None:
        for name, value in (("load_s", load_s), ("read_s", read_s)):
            if value < 0:
                raise ValueError(f"lora {name}={value} must be >= 0")
        self.load_s, self.read_s, self.sleep = load_s, read_s, sleep
        self.loads = 0
        self.load_busy_s = 0.0  # modelled time spent loading adapters into slots

    def read(self, name: str, path: str) -> str:
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise LoraError(f"adapter {name!r}: {config} is missing; an adapter is a PEFT folder with "
                            "adapter_config.json and adapter_model.safetensors")
        if self.sleep and self.read_s:
            time.sleep(self.read_s)
        return name

    def load(self, slot: int, adapter: str) -> None:
        self.loads += 1
        self.load_busy_s += self.load_s
        if self.sleep and self.load_s:
            time.sleep(self.load_s)
