"""Session 17 (2026-11-25): paired A/B of training steps at 32 + 32 tokens, behind docs/benchmarks.md.
Each round times one step of every named variant (common.VARIANTS); prints each variant's median and
its paired ratio to the first one, with a 95% interval. Calls as run that session:

    python docs/bench/s17_components/ab.py bart,full,full_sparse_encoder,zformer,zformer_sparse_encoder 30
    python docs/bench/s17_components/ab.py full,full_sparse,zformer,zformer_sparse,bart 30
    python docs/bench/s17_components/ab.py full,full_fused,zformer,zformer_fused,bart 30
    python docs/bench/s17_components/ab.py fastformer_old,fastformer 40
    python docs/bench/s17_components/ab.py zformer_old,zformer 40
    python docs/bench/s17_components/ab.py full,z_enc,z_dec,z_cross,zformer 40
"""
import sys

from common import compare

if __name__ == "__main__":
    compare(sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 30)
