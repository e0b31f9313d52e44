# Session 17 (2026-11-25) component timing behind docs/benchmarks.md, 'The 32-token level on Zen 4'.
# Ad-hoc measurement script, kept as run (AMD EPYC Zen 4, 2 threads); run from the repository root.
exec(open('docs/bench/s17_components/layers.py').read().split("print(inspect.signature")[0])
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.rows=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        if func.__name__.startswith(('mm','addmm')):
            s.rows.append((func.__name__, [(tuple(a.shape), a.stride(), a.is_contiguous()) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))
for n in ('bart','full'):
    with Log() as L: run_dec(n)
    print(n)
    for r in L.rows: print('  ', r)
