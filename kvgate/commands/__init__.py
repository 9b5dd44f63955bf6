"""Every `kvgate` command, one module each (`kvgate <name>` is `kvgate.commands.<name>`, but for `kvgate redis`, whose
module is embedded_redis), beside the dispatcher (cli.py), its error lines (cli_errors.py) and the flags derived
from settings models (flags.py). Commands sit above every layer: they may import any package, torch only inside
`run`. The benchmarks (`kvgate bench ...`) are their own room, kvgate/bench/."""
