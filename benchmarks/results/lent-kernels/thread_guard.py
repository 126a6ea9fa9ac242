"""Whether a compiled function serves another thread count without compiling again: compiled at
one thread, called at two, with inductor's `cpp.dynamic_threads` off and on (a fresh process
each). Dynamo guards on torch's thread count (its GLOBAL_STATE guard), whatever inductor does
with it:

    TORCH_LOGS=recompiles python benchmarks/results/lent-kernels/thread_guard.py [--dynamic-threads]
"""
import sys

import torch
import torch._inductor.config
from torch._dynamo.utils import counters

if __name__ == "__main__":
    torch._inductor.config.cpp.dynamic_threads = "--dynamic-threads" in sys.argv
    layer = torch.nn.Linear(64, 64).eval().requires_grad_(False)
    step = torch.compile(lambda x: torch.relu(layer(x)) * 2, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        torch.set_num_threads(1)
        step(torch.randn(3, 64))
        one = counters["stats"]["unique_graphs"]
        torch.set_num_threads(2)
        step(torch.randn(3, 64))
    print(f"dynamic threads {torch._inductor.config.cpp.dynamic_threads}: graphs after one thread {one}, "
          f"after two {counters['stats']['unique_graphs']}")
