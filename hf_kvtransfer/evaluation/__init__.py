"""Measuring a mapper: retention and bootstrap intervals (`metrics`), held-out content items (`tasks`), the
continuation scorer (`multiple_choice`), the content evaluations as own prefill / transfer / no context
(`content`), the task suite by name (`evaluate`) and the one time-to-first-token timer (`timing`). Imports `core`.
"""
