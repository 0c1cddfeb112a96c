from django.apps import AppConfig


class ReportsConfig(AppConfig):
    name = "example_project.reports"
    label = "reports"

    def ready(self) -> None:
        from example_project import celery_app  # noqa: F401  (the app, for shared tasks)
