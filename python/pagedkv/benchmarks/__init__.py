"""The engine's benchmarks, behind ``pagedkv bench-engine`` (needs the ``model`` extra).

- ``engine``: the sections (throughput, decode, ``n = 4`` sharing, a shared system prompt,
  memory), ratios from one run;
- ``decode``: pagedkv's decode beside llama.cpp's single stream and the attention kernel beside
  a copy (``--sections decode``);
- ``memory``: KV bytes with hybrid KV groups against every layer full attention
  (``--sections memory``).

They drive ``pagedkv.engine`` from outside it: the engine never imports them.
"""
