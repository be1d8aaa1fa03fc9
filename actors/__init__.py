"""Ray actors of the asynchronous pipeline: thin shells that hold state, move data and call ``distillspec``.

Each lives in its own module and is imported from there (``from actors.weights import WeightStore``): an actor's
process imports only its own module's dependencies, so the weight store and the prompt log start without torch.
"""
