"""Docker images: the sandbox base image, task-built images, Apptainer definitions."""
