"""The teacher bindings: what the teacher pool needs of one (`base.TeacherBackend`), the `hf`, `vllm` and
`openrouter` teachers, what the local teachers share (`local_teacher.py`) and the OpenRouter HTTP client."""
