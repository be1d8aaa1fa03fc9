"""The models: loading a pair (:mod:`.loading`), named pretrained pairs, GGUF imports and drafts made of a model's
layers (:mod:`.pretrained`, :mod:`.split_gguf`), the offline garden pair (:mod:`.garden`), weights laid out for speed
(:mod:`.packing`: prepacked, int8), a draft vocabulary (:mod:`.draft_vocab`), and whether the hub is reachable
(:mod:`.hub`)."""
