"""Tasks: the data sets and their prompts (:mod:`.data`) and the scores they are judged by (:mod:`.scores`)."""
