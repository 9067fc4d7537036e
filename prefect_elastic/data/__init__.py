"""A job's training data: where its samples come from (`sources`: `.npz`, Parquet, a Hugging Face
`datasets` folder, a user's own Dataset), and how they become the named fields of a batch."""
