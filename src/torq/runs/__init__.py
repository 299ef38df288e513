"""The parts of a comparison run that :mod:`torq.pipeline` puts together: its settings and
their checks (:mod:`~torq.runs.config`), where its models come from and are saved
(:mod:`~torq.runs.source`), where its evaluation is kept as it goes (:mod:`~torq.runs.store`)
and what it reports (:mod:`~torq.runs.report`)."""
