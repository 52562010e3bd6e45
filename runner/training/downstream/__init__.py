"""Downstream evaluation (SPEC "Downstream evaluation"): multiple-choice tasks as pinned data,
scored as lm-evaluation-harness's HFLM scores them, in the training loop and by `runner eval`.

Modules: tasks (files, formats, subset), builtin_task (the offline task), encode (HFLM's token
rules and the load-time refusals), score (batched log-likelihoods, ranks in step), metrics, run
(preparing and scoring an experiment's tasks, what a scoring records), posthoc (`runner eval`).
The training loop's call-out is runner.training.inloop_downstream (it reads the loop's Attempt).
"""
