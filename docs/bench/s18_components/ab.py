"""Session 18 (2026-11-25): paired A/B of 32 + 32-token training steps: s17_components/ab.py's `compare`
with this folder's variants (variants.py). Calls as run: `python docs/bench/s18_components/ab.py bart,full,zformer,zformer_fused 30`,
`... zformer,zformer_fused 100`, `... full,zformer,zformer_fused,bart 60`, `... zformer,zformer_fused,full,bart 100`, `... zformer,zformer_cs 100`, `... full,full_views17,full_views68 60`."""
import sys

import variants  # noqa: F401  (registers this folder's variants; puts s17_components on the path)
from common import compare  # noqa: E402

if __name__ == "__main__":
    compare(sys.argv[1].split(","), int(sys.argv[2]))
