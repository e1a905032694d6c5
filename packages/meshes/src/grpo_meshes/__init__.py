"""grpo_meshes."""
