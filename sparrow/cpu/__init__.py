"""The CPU backend: every speed path of float32 decoding on a CPU, behind the seams the engine, the attention
kernels and the vLLM CPU plugin call. None changes a result's bits; each can be switched off (`switches`).

- `kernel`: the compiled kernel (csrc/): the attention of decode, span and teacher-forced steps, the paged decode
  of vLLM's CPU cache, and `small_linear`, the linear layers of a few rows;
- `packed_linear`: the engine's linear layers within a generate call (`small_linear`, oneDNN packs for prefill);
- `fused_layers`: the engine's decoder layers of decode and verification steps in a few ops;
- `huge_pages`: transparent huge pages for KV caches;
- `backend`: what the engine holds (the kernel loaded when it is made, the scope of a generate call).

The package itself imports nothing, so that the attention kernels can import `kernel` while `fused_layers`
imports the attention hook.
"""
