"""Session 18 (2026-11-25): calibration of what a dispatched operator costs inside a training step: our full
model with `n` chained no-op `view`s on each attention module input (n autograd nodes, ~2n operators per module).
With n = 17 a step dispatches 2,845 operators, as zformer's does. Used by ab.py as `full_views17`, `full_views68`."""
from hf_zformer.modeling import attention as A
class ExtraViews:
    """Our full model with `n` chained no-op views on each attention module's input (n autograd nodes, ~2n operators)."""
    def __init__(self, model, n): self.model, self.n = model, n
    def __call__(self, **inputs):
        old = A.FullAttention.forward
        n = self.n
        def forward(self_, hidden_states, *args, **kwargs):
            for _ in range(n):
                hidden_states = hidden_states.view(hidden_states.shape)
            return old(self_, hidden_states, *args, **kwargs)
        A.FullAttention.forward = forward
        try: return self.model(**inputs)
        finally: A.FullAttention.forward = old
    def __getattr__(self, k): return getattr(self.model, k)
