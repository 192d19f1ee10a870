"""The model plane: one Llama-family decoder (`decoder`) with its layers and CPU kernels
(`attention`, `decode_attention`, `linear`, `rms_norm`, `rope`, `native` + `csrc/`) and GPU kernels
(`triton_attention`, `triton_fused`, in Triton: `triton_kernels`), where a checkpoint's
files are (`hub`: a directory, or a hub id through the Hugging Face cache), the loader
(`loader`), what a checkpoint is without its weights (`info`, light enough for the router), and
the factories that write deterministic random-weight checkpoints and tokenizers for tests and
demos (`make_model`, `tokenizer_factory`).

May import: the `cluster` root modules only.
"""
