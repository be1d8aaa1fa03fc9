"""Measuring a pair: alpha, tau, the task score and wall-clock speed (:mod:`.measure`), the experiments of the
paper's study (:mod:`.study`), and the tables and plots of the results (:mod:`.report`)."""
