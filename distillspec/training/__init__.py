"""Distillation (the paper's Algorithm A.2): the divergences (:mod:`.divergences`) and the loss over a batch
(:mod:`.losses`), the learner's step (:mod:`.learner`), where each batch's data comes from (:mod:`.rollout`) and how a
batch travels to the learner (:mod:`.batches`)."""
