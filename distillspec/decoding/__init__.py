"""The speculative decoder: draft and verify with exact rejection sampling (:mod:`.speculative`), the KV cache it
decodes with (:mod:`.kvcache`), sampling controls applied alike to both models (:mod:`.sampling`), gamma chosen live
(:mod:`.auto_gamma`), and its measures: alpha, tau, the cost ratio c, predicted speedups (:mod:`.metrics`)."""
