from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('conversations', '0015_brief_enqueue_missed'),
    ]

    operations = [
        migrations.AddField(
            model_name='consolidation',
            name='heartbeat_at',
            field=models.DateTimeField(auto_now_add=True, null=True),
        ),
    ]
