"""CPU-only publishing: anchor checkpoint -> inference model -> validation -> MLflow registry.

Entry points: ``publish.pipeline.publish`` (Python), ``python -m publish`` (CLI) and the
``publish`` Prefect flow (flows/publish_flow.py). Imports nothing heavy at package level.
"""
