"""Property-based fuzzing (hypothesis) of every decoder that reads bytes off the network: token
frames (`test_token_frames`), KV chunk frames, headers and collective announcements
(`test_kv_frames`), KV handles, endpoints, capability tokens and NIXL pool descriptions
(`test_kv_handles`), gRPC `GenerateRequest`s (`test_generate_requests`) and OpenAI bodies
(`test_openai_bodies`) into a `Request`. Each test feeds arbitrary bytes and structured
mutations of the committed seed corpus (`corpus/`, written by `make_corpus`) and asserts that
only the decoder's documented refusal comes out. The cases are derandomized (the same ones on
every run, about ten thousand in all); `PDSERVE_FUZZ_SCALE=20` runs twenty times as many."""
