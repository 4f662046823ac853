"""Planning runs before they start and predicting them after: a compute budget turned into a run (``budget``, on the
Llama shapes of ``shapes``), the plan written as text and as a recipe (``write``), and the planner's prediction at a
finished run's own configuration (``prediction``), which ``report.md`` sets against what was measured."""
