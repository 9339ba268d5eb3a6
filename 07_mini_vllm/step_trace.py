"""What the model saw each step, traced from outside the engine.

The engine keeps no record of its inputs for anyone's benefit: a notebook, a test or a benchmark
that wants a step's tensors wraps the model runner's methods on the instance for the duration of a
block, as `benchmarks/profile_decode_step.py` wraps the phases it times, and the class methods
show again afterwards. The runner must be in this process (`UniProcExecutor`).

    with ModelInputsTrace(engine) as trace:
        engine.step()
        so = engine.last_step.scheduler_output
        inputs = trace.inputs_of(so)        # ModelInputs: input_ids, positions, attn_metadata, ...

Pairing by the step's `SchedulerOutput` (the object the core handed the runner) is what makes it
right under async scheduling: the step the engine returns is the one whose output it applied,
while the runner may already be running the next batch in its worker thread.

Read a step's inputs right after the step: on a GPU the runner stages inputs in buffers used in
turn (input_staging.py), so two steps later they hold another step's values.

What is recorded: the inputs of the target model's forward (`_execute_rows`: after the attention
plan is attached, as the model receives them). A drafter's forwards are not; when one bad request
made the runner run the batch again without it (request_isolation.py), the last attempt's.
"""
from __future__ import annotations

import threading

from mini_vllm.model_inputs import ModelInputs

_WRAPPED = ("execute_model", "_execute_rows", "_with_attention_plan")


class ModelInputsTrace:
    def __init__(self, engine):
        runner = getattr(engine.engine_core, "model_runner", None)
        if runner is None:
            raise ValueError("ModelInputsTrace needs the model runner in this process "
                             "(no tensor / pipeline parallelism, the engine core in this process)")
        self._runner = runner
        self._steps: list[tuple[object, ModelInputs | None]] = []   # (scheduler_output, its inputs)
        self._local = threading.local()                             # async: the runner's own thread

    @property
    def last_scheduler_output(self):
        """The step the runner ran last (under async scheduling: possibly one the engine has not
        returned yet)."""
        return self._steps[-1][0] if self._steps else None

    def inputs_of(self, scheduler_output) -> ModelInputs | None:
        """The inputs of the forward that ran `scheduler_output` (None: it ran none, e.g. an empty step)."""
        for so, inputs in reversed(self._steps):
            if so is scheduler_output:
                return inputs
        return None

    # ------------------------------------------------------------------ the wrappers
    def __enter__(self) -> "ModelInputsTrace":
        runner, local = self._runner, self._local
        execute_model, execute_rows, with_plan = (runner.execute_model, runner._execute_rows,
                                                  runner._with_attention_plan)

        def traced_execute_model(scheduler_output):
            local.inputs, local.in_rows = None, False
            try:
                return execute_model(scheduler_output)
            finally:
                self._steps.append((scheduler_output, local.inputs))
                del self._steps[:-4]                        # the recent steps: their buffers are still theirs

        def traced_execute_rows(*args, **kwargs):
            local.in_rows = True
            try:
                return execute_rows(*args, **kwargs)
            finally:
                local.in_rows = False

        def traced_with_plan(inputs, *args):
            inputs = with_plan(inputs, *args)
            if getattr(local, "in_rows", False):
                local.inputs = inputs
            return inputs

        self._before = {name: runner.__dict__.get(name) for name in _WRAPPED}   # another wrapper, if any
        runner.execute_model = traced_execute_model
        runner._execute_rows = traced_execute_rows
        runner._with_attention_plan = traced_with_plan
        return self

    def __exit__(self, *exc) -> None:
        for name, before in self._before.items():
            if before is None:
                self._runner.__dict__.pop(name, None)      # the class method shows again
            else:
                setattr(self._runner, name, before)
