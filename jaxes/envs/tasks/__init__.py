"""Terminal tasks: the task model, the generator and its families, task-folder loaders, verification, and the two terminal environment kinds."""
