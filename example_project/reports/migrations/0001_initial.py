from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []

    operations = [
        migrations.CreateModel(
            name="Report",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("fence_token", models.BigIntegerField(db_index=True, default=0)),
                ("topic", models.CharField(max_length=200)),
                ("inject", models.CharField(blank=True, default="", max_length=20)),
                ("status", models.CharField(default="new", max_length=20)),
                ("summary", models.TextField(blank=True, default="")),
                ("writes", models.IntegerField(default=0)),
            ],
        ),
    ]
