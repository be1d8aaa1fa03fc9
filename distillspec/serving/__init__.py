"""Serving completions, free of Ray and HTTP: this project's engine (:mod:`.completer`: continuous batching of
speculative decoding, streaming, new draft versions between blocks) and vLLM as an engine of rollouts, scorers and the
endpoint (:mod:`.vllm_backend`, with the code that runs inside vLLM's processes: :mod:`.vllm_scheduler`,
:mod:`.vllm_worker`)."""
