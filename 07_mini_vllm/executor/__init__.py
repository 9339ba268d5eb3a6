"""Executors: who runs the model's ranks for the EngineCore (vLLM: vllm/v1/executor/)."""
from mini_vllm.executor.abstract import Executor, ExecutorError
from mini_vllm.executor.multiproc_executor import MultiprocExecutor
from mini_vllm.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "ExecutorError", "MultiprocExecutor", "UniProcExecutor"]
