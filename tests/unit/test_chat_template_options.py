"""A chat template given instead of the model's (--chat-template) and a request's chat_template_kwargs."""
from __future__ import annotations

import pytest

from services.launcher_commands import router_command
from services.router.config import RouterConfig
from services.serve_config import ServeConfig
from shared.errors import InvalidRequest
from shared.model_files import default_model_path
from shared.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if shout %}!{% endif %}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def test_an_override_template_renders_with_the_request_variables(tok):
    own = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    other = Tokenizer(default_model_path())
    other.use_chat_template(TEMPLATE)
    assert other.apply_chat_template([{"role": "user", "content": "hi"}]) == tok.encode("[user] hi\n") != own
    assert other.apply_chat_template([{"role": "user", "content": "hi"}], template_kwargs={"shout": True}) == \
        tok.encode("[user] hi\n!")
    hi = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(hi, template_kwargs={"enable_thinking": False}) == own
    for name in ("tools", "messages", "add_generation_prompt"):            # the renderer's own: refused, not a crash
        with pytest.raises(InvalidRequest, match=name):
            tok.apply_chat_template(hi, template_kwargs={name: False})


def test_the_flag_reaches_the_router_and_a_missing_file_is_refused(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    cmd = router_command(ServeConfig(chat_template=str(path)))
    assert cmd[cmd.index("--chat-template") + 1] == str(path)
    assert "--chat-template" not in router_command(ServeConfig())
    RouterConfig(chat_template=str(path))
    for make in (lambda: ServeConfig(chat_template=str(tmp_path / "none")),
                 lambda: RouterConfig(chat_template=str(tmp_path / "none"))):
        with pytest.raises(ValueError, match="not a file"):
            make()
