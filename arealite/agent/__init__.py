"""Agents written against familiar APIs, trained unchanged: :class:`ArealOpenAI` (an OpenAI-style
chat client over the inference engine) and :class:`OpenAIAgentWorkflow`."""

from arealite.agent.openai_client import ArealOpenAI, ChatCompletion, CompletionRecord, OpenAIAgentWorkflow

__all__ = ["ArealOpenAI", "ChatCompletion", "CompletionRecord", "OpenAIAgentWorkflow"]
