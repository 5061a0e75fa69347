import sys

import numpy as np
import ropeattn

client = ropeattn.Client(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
rng = np.random.default_rng(0)

# RoPE (Llama 3 scaling) on a [batch, seq, heads, head_dim] array.
x = rng.standard_normal((1, 16, 8, 64), dtype=np.float32)
y = client.rope_apply(x, rope={"theta": 500000, "scaling": {"rope_type": "llama3", "factor": 8,
                                                             "original_max_position_embeddings": 8192}})
print("rope_apply:", y.shape, "norms kept:", np.allclose(np.linalg.norm(y, axis=-1),
                                                         np.linalg.norm(x, axis=-1), rtol=1e-5))
# A 10-step decode: 8 query heads over 2 kv heads, default RoPE.
with client.session(heads=8, kv_heads=2, head_dim=64, max_context=64, rope={}) as session:
    for t in range(10):
        out = session.step(*(rng.standard_normal((1, 1, h, 64), dtype=np.float32) for h in (8, 2, 2)))
    print("decode: 10 steps, last output", out.shape)
