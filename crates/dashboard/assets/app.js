// The dashboard's only script of its own: error answers shown in the error box, and the
// sandbox terminal (xterm.js over the dashboard's WebSocket bridge).
"use strict";

document.addEventListener("htmx:beforeSwap", function (event) {
  // Failed actions answer an error box aimed at #errors (HX-Retarget): show it.
  if (event.detail.xhr.status >= 400) {
    event.detail.shouldSwap = true;
    event.detail.isError = false;
  }
});

document.addEventListener("htmx:afterRequest", function (event) {
  // A successful action clears the last error (the status, since a shown error counts as
  // swapped content for htmx).
  var errors = document.getElementById("errors");
  var status = event.detail.xhr ? event.detail.xhr.status : 0;
  if (errors && status >= 200 && status < 400 && event.detail.requestConfig.verb !== "get") {
    errors.innerHTML = "";
  }
});

function startTerminal(box) {
  if (box.dataset.started) {
    return;
  }
  box.dataset.started = "1";
  var term = new Terminal({ cursorBlink: true, fontSize: 14, convertEol: false });
  var fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  var scheme = location.protocol === "https:" ? "wss://" : "ws://";
  var url = scheme + location.host + box.dataset.socket +
    "&cols=" + term.cols + "&rows=" + term.rows;
  var socket = new WebSocket(url);
  socket.binaryType = "arraybuffer";
  var opened = false;
  socket.addEventListener("open", function () {
    opened = true;
    term.loadAddon(new AttachAddon.AttachAddon(socket));
    box.dataset.connected = "1";
    term.focus();
  });
  socket.addEventListener("close", function () {
    box.dataset.connected = "";
    // A refused handshake carries no reason to the page; say so and let the user retry.
    term.write(opened ? "\r\n[the terminal closed]\r\n" : "[the terminal could not connect]\r\n");
    box.dataset.closed = opened ? "closed" : "refused";
    var button = document.getElementById("open-terminal");
    if (button) {
      button.hidden = false;
      button.textContent = "Reconnect terminal";
    }
  });
  window.addEventListener("resize", function () {
    fit.fit();
    if (socket.readyState === WebSocket.OPEN) {
      // 0xff 'R' then "cols,rows": the bridge's resize message.
      var text = term.cols + "," + term.rows;
      var bytes = new Uint8Array(2 + text.length);
      bytes[0] = 0xff;
      bytes[1] = 0x52;
      for (var i = 0; i < text.length; i++) {
        bytes[2 + i] = text.charCodeAt(i);
      }
      socket.send(bytes);
    }
  });
}

document.addEventListener("click", function (event) {
  var button = event.target.closest("[data-open-terminal]");
  if (button) {
    var box = document.getElementById("terminal");
    if (box.dataset.closed) {
      // A fresh terminal for a fresh shell: the closed one is dropped.
      box.innerHTML = "";
      delete box.dataset.started;
      delete box.dataset.closed;
    }
    box.hidden = false;
    button.hidden = true;
    startTerminal(box);
  }
});

// A file input with data-load-into fills the named text area with the file's text, so a
// Dockerfile on disk goes the way a pasted one does. Files over 1 MiB are refused here; the
// server holds the form to its own limit anyway.
document.addEventListener("change", function (event) {
  var input = event.target.closest("input[type=file][data-load-into]");
  if (!input || !input.files || input.files.length === 0) {
    return;
  }
  var target = document.getElementById(input.dataset.loadInto);
  var file = input.files[0];
  if (file.size > 1048576) {
    document.getElementById("errors").innerHTML =
      '<div class="error" role="alert">the file is larger than 1 MiB</div>';
    return;
  }
  file.text().then(function (text) {
    target.value = text;
  });
});
