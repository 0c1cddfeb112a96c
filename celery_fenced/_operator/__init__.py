"""The operator's tools: the ``celery fenced`` command (:mod:`.cli`), its listings
(:mod:`.listing`), cancel, redrive and restore (:mod:`.control`), settings advice from the
measured gaps (:mod:`.tuning`) and the shipped dashboards and alert rules (:mod:`.dashboards`)."""
