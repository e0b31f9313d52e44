# Session 17 (2026-11-25): zformer in one part of the seq2seq model at a time, behind docs/benchmarks.md. Ad-hoc script, kept as run: python ab6.py full,z_enc,z_dec,z_cross,zformer 40
"""A/B of training steps at 32+32, paired rounds: models built by name; variants via patch functions."""
import torch, time, statistics, sys, random
from hf_zformer.benchmark.seq2seq import build_seq2seq, Seq2SeqShape
from hf_zformer.benchmark import paired_ratio_interval
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
shape=Seq2SeqShape(batch=4,source_length=32,target_length=32,width=512,layers=6,heads=8,ffn=2048,vocab=8000)
g=torch.Generator().manual_seed(0)
src=torch.randint(3,8000,(4,32),generator=g); lab=torch.randint(3,8000,(4,32),generator=g); am=torch.ones_like(src)
def sparse(m):
    m.encoder.embeddings.word_embeddings.sparse=True
    return m
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.modeling_zformer import ZformerForConditionalGeneration
def custom(enc, dec, cross):
    def build():
        cfg=ZformerConfig(vocab_size=8000, hidden_size=512, num_hidden_layers=6, num_decoder_layers=6, num_attention_heads=8,
            intermediate_size=2048, max_position_embeddings=34, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attention_type=enc, decoder_attention_type=dec, cross_attention_type=cross, attn_implementation="sdpa")
        return ZformerForConditionalGeneration(cfg)
    return build
CUSTOM=dict(z_enc=custom('zformer','full','full'), z_dec=custom('full','zformer','full'), z_cross=custom('full','full','zformer'))
VARIANTS=dict(bart=('bart',None), full=('full',None), full_sparse=('full',sparse), zformer=('zformer',None), zformer_sparse=('zformer',sparse))
names=sys.argv[1].split(',') ; rounds=int(sys.argv[2]) if len(sys.argv)>2 else 30
R={}
for n in names:
    if n in CUSTOM:
        torch.manual_seed(0); m=CUSTOM[n](); patch=None
    else:
        base,patch=VARIANTS[n]; torch.manual_seed(0); m,_=build_seq2seq(base,shape)
    if patch: m=patch(m)
    m.train(); R[n]=(m,torch.optim.AdamW(m.parameters(),lr=1e-4,fused=True))
T={n:[] for n in names}
for it in range(rounds+3):
    for n in names:
        m,opt=R[n]
        t0=time.perf_counter(); loss=m(input_ids=src,attention_mask=am,labels=lab).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        d=time.perf_counter()-t0
        if it>=3: T[n].append(d)
for n in names:
    print(n, round(statistics.median(T[n])*1e3,1),'ms', 'vs', names[0], [round(x,3) for x in paired_ratio_interval(T[names[0]],T[n])])
