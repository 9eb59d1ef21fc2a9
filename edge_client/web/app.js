// The draftwire edge page: conversations kept by the edge (/api/conversations), replies streamed as
// server-sent events in the OpenAI chunk format, each reply's figures from its final chunk.
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;      // the open conversation's id
let controller = null;   // aborts the reply in flight (the Stop button)
let making = null;       // a new conversation being made (New chat): a message sent meanwhile goes there

// With `draftwire edge --api-key-file`, every API request needs the key: asked for once, kept for this tab.
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("draftwire-api-key");
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function authorized(path, options) {
  let response = await fetch(path, { ...options, headers: headers() });
  if (response.status === 401) {
    const key = window.prompt("This edge needs its API key:");
    if (key) {
      sessionStorage.setItem("draftwire-api-key", key.trim());
      response = await fetch(path, { ...options, headers: headers() });
    }
  }
  return response;
}

async function api(path, options = {}) {
  const response = await authorized(path, options);
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response.status === 204 ? null : response.json();
}

function showError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

function figuresText(figures) {
  if (figures && !figures.timings && figures.finish_reason === "cancelled") return "stopped";
  if (!figures || !figures.timings) return "";
  const t = figures.timings;
  const parts = [
    `${t.predicted_n} tokens`,
    `acceptance ${Math.round(100 * t.acceptance_rate)}%`,
    `${t.tokens_per_round.toFixed(2)} tokens/round`,
    `${t.predicted_per_second.toFixed(1)} tokens/s`,
    `first token ${Math.round(t.time_to_first_token_ms)} ms`,
    `prefill ${t.prompt_n} (cached ${t.cache_n})`,
  ];
  // Speculation that did not pay (the edge's tuner turned it off, and probes it again): said, with the
  // tokens decoded without it; the tuner's reason is the line's tooltip (setFigures).
  const without = [
    t.server_tokens ? `${t.server_tokens} decoded by the verifier alone` : "",
    t.plain_steps ? `${t.plain_steps} plain steps` : "",
  ].filter(Boolean).join(", ");
  if ((t.speculation && t.speculation !== "on") || without) {
    parts.push(`speculation ${t.speculation}` + (without ? ` (${without})` : ""));
  }
  if (figures.finish_reason === "cancelled") parts.push("stopped");
  return parts.join(" · ");
}

// A reply's text as markdown: marked makes the HTML, DOMPurify strips from it anything that could run (a
// model's output is untrusted), and images too: the page fetches nothing a model names. Both libraries are
// vendored in web/vendor. A user's own message stays plain text.
const SANITIZE = { FORBID_TAGS: ["img", "style", "form", "input", "button", "textarea", "select"] };
function render(el, markdown) {
  el.innerHTML = DOMPurify.sanitize(marked.parse(markdown, { gfm: true, breaks: true }), SANITIZE);
}

// `source`: the message's text as stored (a reply's markdown); what Stop says was shown.
function setText(div, text) {
  div.source = text;
  const el = div.querySelector(".text");
  if (div.classList.contains("assistant")) render(el, text); else el.textContent = text;
}

function addMessage(role, content, figures) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = '<div class="who"></div><div class="text"></div><div class="figures"></div>';
  div.querySelector(".who").textContent = role === "user" ? "you" : "draftwire";
  setText(div, content);
  setFigures(div, figures);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setFigures(div, figures) {
  const el = div.querySelector(".figures");
  el.textContent = figuresText(figures);
  el.title = (figures && figures.timings && figures.timings.speculation_reason) || "";
  el.classList.toggle("cancelled", !!figures && figures.finish_reason === "cancelled");
}

async function loadList() {
  const { conversations } = await api("/api/conversations");
  const ul = $("conversations");
  ul.innerHTML = "";
  for (const c of conversations) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    li.className = c.id === current ? "active" : "";
    li.innerHTML = '<span></span><button title="Delete">×</button>';
    li.querySelector("span").textContent = c.title;
    li.querySelector("span").onclick = () => { openSidebar(false); openConversation(c.id); };
    li.querySelector("button").onclick = async () => {
      await api(`/api/conversations/${c.id}`, { method: "DELETE" });
      if (current === c.id) { current = null; $("messages").innerHTML = ""; location.hash = ""; }
      await loadList();
    };
    ul.appendChild(li);
  }
  return conversations;
}

// `keepForm`: a conversation just made from the form's settings leaves the form as it is now (the user may
// have changed it while the conversation was being made); any other takes its stored settings.
async function openConversation(id, keepForm = false) {
  const c = await api(`/api/conversations/${id}`);
  current = id;
  location.hash = id;
  $("messages").innerHTML = "";
  for (const m of c.messages) addMessage(m.role, m.content, m.figures);
  if (!keepForm) {
    $("temperature").value = c.settings.temperature;
    $("max-tokens").value = c.settings.max_tokens;
    $("probs").checked = c.settings.logprobs !== null && c.settings.logprobs !== undefined;
  }
  await loadList();
}

function settings() {
  const probs = $("probs").checked;
  return {
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    logprobs: probs,
    ...(probs ? { top_logprobs: 3 } : {}),
  };
}

// A token of the reply as a span whose title gives its probability under the target and the likeliest
// alternatives at its position (the verifier's own figures, from the logits it chose the token with).
function tokenSpan(t) {
  const span = document.createElement("span");
  const percent = (lp) => `${(100 * Math.exp(lp)).toFixed(1)}%`;
  span.className = Math.exp(t.logprob) < 0.1 ? "tok unlikely" : "tok";
  span.textContent = t.token;
  span.title = [`${JSON.stringify(t.token)} ${percent(t.logprob)}`]
    .concat(t.top_logprobs.map((a) => `  ${JSON.stringify(a.token)} ${percent(a.logprob)}`))
    .join("\n");
  return span;
}

async function newConversation() {
  const mine = (making = (async () => {
    const body = JSON.stringify({ settings: settings() });
    const c = await api("/api/conversations", { method: "POST", body });
    await openConversation(c.id, true);
  })());
  try { await mine; } finally { if (making === mine) making = null; }
}

// A stopped reply's figures (its tokens, acceptance and rate, marked stopped) once the edge has stored it,
// a moment after the stream closed; until then, "stopped".
async function stoppedFigures(reply, id) {
  for (let i = 0; i < 40 && reply.isConnected; i++) {
    await new Promise((resolve) => setTimeout(resolve, 250));
    let c;
    try { c = await api(`/api/conversations/${id}`); } catch (e) { return; }
    const last = c.messages[c.messages.length - 1];
    if (last && last.role === "assistant" && last.figures && last.figures.finish_reason === "cancelled") {
      if (reply.isConnected && current === id) setFigures(reply, last.figures);
      return;
    }
  }
}

async function send(text) {
  if (making) await making.catch(() => {});
  if (!current) await newConversation();
  showError("");
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".text");
  const id = current;
  reply.classList.add("typing");  // until the first token (or an error, or Stop)
  let drawn = false;  // a render of the reply's markdown is scheduled
  const draw = () => {
    if (drawn) return;
    drawn = true;
    requestAnimationFrame(() => { drawn = false; if (!out.classList.contains("tokens")) render(out, reply.source); });
  };
  controller = new AbortController();
  stopping = null;
  $("send").hidden = true; $("stop").hidden = false;
  try {
    const response = await authorized(`/api/conversations/${current}/messages`, {
      method: "POST",
      body: JSON.stringify({ content: text, stream: true, settings: settings() }),
      signal: controller.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(body.error.message);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", replyText = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end).replace(/^data: /, "");
        buffer = buffer.slice(end + 2);
        if (event === "[DONE]") continue;
        const chunk = JSON.parse(event);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        if (stopping !== null) break;
        if (choice && choice.delta && choice.delta.content) {
          reply.classList.remove("typing");
          replyText += choice.delta.content;
          reply.source = replyText;
          if (!choice.logprobs) draw();
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        // With token probabilities, the reply is shown as its tokens (plain text), each with its figures.
        if (choice && choice.logprobs) {
          out.classList.add("tokens");
          for (const t of choice.logprobs.content) out.appendChild(tokenSpan(t));
        }
        if (choice && choice.finish_reason) {
          reply.classList.remove("typing");
          if (out.classList.contains("tokens")) {
            if (out.textContent !== replyText) out.textContent = replyText;  // a stop string cut the tokens' text
          } else {
            render(out, replyText);
          }
          setFigures(reply, { ...chunk, finish_reason: choice.finish_reason });
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      if (!out.classList.contains("tokens")) render(out, reply.source);
      setFigures(reply, { finish_reason: "cancelled" });
      stoppedFigures(reply, id);
    } else {
      if (!out.textContent) reply.remove();  // nothing was committed: no empty bubble, the error instead
      showError(e.message);
    }
  } finally {
    reply.classList.remove("typing");
    controller = null;
    $("send").hidden = false; $("stop").hidden = true;
    await loadList();
  }
}

$("composer").onsubmit = (event) => {
  event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || controller) return;
  $("input").value = "";
  send(text);
};
$("input").onkeydown = (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
};
// Stop: the text shown now is what is kept. The page stops showing more, tells the edge what it showed
// (the edge has sent, and counted, a little more before it notices the closed stream), then closes it.
let stopping = null;   // the reply's text when Stop was pressed
$("stop").onclick = () => {
  if (!controller) return;
  const reply = document.querySelector(".msg.assistant:last-child");
  stopping = reply ? reply.source : "";
  const id = current;
  controller.abort();
  api(`/api/conversations/${id}/stop`, { method: "POST", body: JSON.stringify({ shown: stopping }) })
    .catch(() => {});
};
$("new-chat").onclick = () => { openSidebar(false); newConversation(); };
// Narrow screens (style.css): the sidebar opens over the chat from ☰, and closes on a choice or outside it.
function openSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("menu").setAttribute("aria-expanded", String(open));
}
$("menu").onclick = (event) => { event.stopPropagation(); openSidebar(!document.body.classList.contains("sidebar-open")); };
$("messages").onclick = () => openSidebar(false);

(async function start() {
  try {
    const models = await api("/v1/models");
    const m = models.data[0];
    $("model").textContent = `${m.id}, verified remotely (${m.meta.verifier}); draft ${m.meta.draft} on this device`;
  } catch (e) {
    $("model").textContent = "";
    showError(`verifier: ${e.message}`);
  }
  $("temperature").value = 0.7;
  $("max-tokens").value = 256;
  const conversations = await loadList();
  const wanted = location.hash.slice(1) || (conversations[0] && conversations[0].id);
  if (wanted && conversations.some((c) => c.id === wanted)) await openConversation(wanted);
})();
