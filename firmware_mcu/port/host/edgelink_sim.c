/*
 * edgelink-sim: a stand-in MCU on the host. It speaks edgelink on stdin/stdout or on a pty it
 * creates (its slave path is printed as "PTY <path>"), keeps its model slots in a file, streams
 * synthetic detections at a set rate once the host has sent HELLO, paced to a baud rate, and takes
 * signed model updates.
 *
 *   edgelink-sim --storage FILE [--key PUBKEY.pub]... [--pty] [--rate N] [--count N] [--baud N]
 *                [--device-id N] [--slot-size N] [--heartbeat-ms N] [--power-cut-after N] [--corrupt-every N]
 *   edgelink-sim --vectors      print C-encoded frames as JSON (firmware_mcu/tests/vectors/c_frames.json)
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "edgelink.h"
#include "el_describe.h"
#include "file_storage.h"
#include "modelslot.h"

#define FW_VERSION 0x00010000u
#define TX_RING 8192u
#define CONTROL_RESERVE 1024u /* detections never take the room an ACK needs */
#define FRAME_W 96u
#define FRAME_H 96u

typedef struct {
    int in_fd, out_fd;
    uint8_t ring[TX_RING];
    size_t head, used;
    uint16_t seq;
    double tokens, bytes_per_s;
    int host_ready; /* the host said HELLO: stream detections from now on */
    unsigned long corrupt_every, frames_out; /* fault injection: damage every Nth frame on the wire */
    double last_refill;
    uint32_t device_id;
    el_heartbeat hb;
    modelslot ms;
    file_storage fs;
} sim;

static volatile sig_atomic_t stopping;

static void on_signal(int sig)
{
    (void)sig;
    stopping = 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static size_t ring_free(const sim *s)
{
    return TX_RING - s->used;
}

static int ring_push(sim *s, const uint8_t *data, size_t len)
{
    size_t i;
    if (ring_free(s) < len) {
        return -1;
    }
    for (i = 0; i < len; i++) {
        s->ring[(s->head + s->used + i) % TX_RING] = data[i];
    }
    s->used += len;
    return 0;
}

static int send_message(sim *s, el_message *m, size_t reserve)
{
    uint8_t out[EL_MAX_ENCODED];
    size_t n = 0;
    m->seq = s->seq;
    if (el_message_encode(m, out, sizeof out, &n) != EL_OK || ring_free(s) < n + reserve) {
        return -1;
    }
    s->seq++;
    if (s->corrupt_every > 0 && ++s->frames_out % s->corrupt_every == 0) {
        out[n / 2] ^= out[n / 2] == 0x01 ? 0x02 : 0x01; /* never turns a byte into the delimiter */
    }
    return ring_push(s, out, n);
}

/* Write what the pacing allows: a pty has no baud rate, so the sim keeps to the one it was given. */
static void flush_ring(sim *s)
{
    double t = now_s();
    size_t allowed, chunk;
    ssize_t w;
    if (s->bytes_per_s > 0) {
        s->tokens += (t - s->last_refill) * s->bytes_per_s;
        if (s->tokens > s->bytes_per_s / 100.0 + EL_MAX_ENCODED) {
            s->tokens = s->bytes_per_s / 100.0 + EL_MAX_ENCODED;
        }
        s->last_refill = t;
        allowed = (size_t)s->tokens;
    } else {
        allowed = s->used;
    }
    while (s->used > 0 && allowed > 0) {
        chunk = TX_RING - s->head;
        if (chunk > s->used) {
            chunk = s->used;
        }
        if (chunk > allowed) {
            chunk = allowed;
        }
        w = write(s->out_fd, s->ring + s->head, chunk);
        if (w <= 0) {
            break;
        }
        s->head = (s->head + (size_t)w) % TX_RING;
        s->used -= (size_t)w;
        allowed -= (size_t)w;
        if (s->bytes_per_s > 0) {
            s->tokens -= (double)w;
        }
    }
}

static void send_hello(sim *s)
{
    el_message m;
    ms_slot_info info;
    uint8_t slot = MS_NO_SLOT;
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_HELLO;
    m.u.hello.device_id = s->device_id;
    m.u.hello.fw_version = FW_VERSION;
    m.u.hello.frame_width = FRAME_W;
    m.u.hello.frame_height = FRAME_H;
    if (ms_active(&s->ms, &slot, &info) == MS_OK) {
        m.u.hello.model_version = info.version;
        memcpy(m.u.hello.model_name, info.name, EL_MODEL_NAME_LEN);
    }
    m.u.hello.active_slot = slot;
    (void)send_message(s, &m, 0);
}

static void send_heartbeat(sim *s, double start)
{
    el_message m;
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_HEARTBEAT;
    m.u.heartbeat = s->hb;
    m.u.heartbeat.uptime_ms = (uint32_t)((now_s() - start) * 1000.0);
    (void)send_message(s, &m, 0);
}

static uint8_t nack_reason(ms_status st)
{
    switch (st) {
    case MS_ERR_UNKNOWN_KEY: return EL_NACK_UNKNOWN_KEY;
    case MS_ERR_BAD_SIGNATURE: return EL_NACK_BAD_SIGNATURE;
    case MS_ERR_BAD_MANIFEST: return EL_NACK_BAD_MANIFEST;
    case MS_ERR_ROLLBACK: return EL_NACK_ROLLBACK;
    case MS_ERR_TOO_LARGE: return EL_NACK_TOO_LARGE;
    case MS_ERR_NO_SESSION: return EL_NACK_NO_SESSION;
    case MS_ERR_BAD_OFFSET: return EL_NACK_BAD_OFFSET;
    case MS_ERR_INCOMPLETE: return EL_NACK_INCOMPLETE;
    case MS_ERR_HASH_MISMATCH: return EL_NACK_HASH_MISMATCH;
    default: return EL_NACK_STORAGE;
    }
}

static void reply(sim *s, const el_message *to, ms_status st, uint32_t value)
{
    el_message m;
    memset(&m, 0, sizeof m);
    m.type = st == MS_OK ? EL_MSG_ACK : EL_MSG_NACK;
    m.u.ack.acked_type = to->type;
    m.u.ack.acked_seq = to->seq;
    m.u.ack.reason = st == MS_OK ? 0 : nack_reason(st);
    m.u.ack.value = value;
    (void)send_message(s, &m, 0);
    flush_ring(s);
}

static void power_cut_check(sim *s)
{
    if (s->fs.cut) {
        /* The storage lost power mid-write: the MCU is gone, as it would be. */
        _exit(3);
    }
}

static void handle_frame(sim *s, const el_frame *f)
{
    el_message m, r;
    el_status st = el_message_decode(f, &m);
    ms_status ms_st;
    uint32_t offset = 0;
    ms_slot_info info;
    uint8_t slot;
    if (st != EL_OK) {
        memset(&r, 0, sizeof r);
        r.type = EL_MSG_NACK;
        r.u.ack.acked_type = f->type;
        r.u.ack.acked_seq = f->seq;
        r.u.ack.reason = st == EL_ERR_TYPE ? EL_NACK_UNKNOWN_TYPE : EL_NACK_MALFORMED;
        (void)send_message(s, &r, 0);
        return;
    }
    switch (m.type) {
    case EL_MSG_HELLO:
        s->host_ready = 1;
        send_hello(s);
        break;
    case EL_MSG_OTA_BEGIN:
        ms_st = ms_begin(&s->ms, m.u.ota_begin.manifest, m.u.ota_begin.key_id, m.u.ota_begin.signature, &offset);
        power_cut_check(s);
        reply(s, &m, ms_st, offset);
        break;
    case EL_MSG_OTA_CHUNK:
        ms_st = ms_write(&s->ms, m.u.ota_chunk.offset, m.u.ota_chunk.data, m.u.ota_chunk.len);
        power_cut_check(s);
        reply(s, &m, ms_st, s->ms.received);
        break;
    case EL_MSG_OTA_END:
        ms_st = ms_finish(&s->ms);
        power_cut_check(s);
        if (ms_st == MS_OK) {
            /* "Loading" the model here is re-checking the stored image; a real MCU would init its interpreter. */
            ms_st = ms_verify_slot(&s->ms, s->ms.meta.active);
            ms_st = ms_st == MS_OK ? ms_commit(&s->ms) : ms_rollback(&s->ms);
            power_cut_check(s);
        }
        if (ms_active(&s->ms, &slot, &info) != MS_OK) {
            info.version = 0;
        }
        reply(s, &m, ms_st, info.version);
        send_hello(s);
        break;
    default:
        break; /* detections, heartbeats and logs are the MCU's to send */
    }
}

static int load_key(const char *path, ms_key *key)
{
    char line[256], last[256] = "";
    uint8_t raw[64];
    size_t n = 0;
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return -1;
    }
    while (fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] != '\0' && strncmp(line, "untrusted comment:", 18) != 0) {
            memcpy(last, line, sizeof last);
        }
    }
    fclose(f);
    if (sodium_base642bin(raw, sizeof raw, last, strlen(last), NULL, &n, NULL, sodium_base64_VARIANT_ORIGINAL) != 0 ||
        n != 2 + MS_KEY_ID_LEN + MS_PUBLIC_KEY_LEN || raw[0] != 'E' || raw[1] != 'd') {
        return -1;
    }
    memcpy(key->key_id, raw + 2, MS_KEY_ID_LEN);
    memcpy(key->public_key, raw + 2 + MS_KEY_ID_LEN, MS_PUBLIC_KEY_LEN);
    return 0;
}

static int open_pty(sim *s)
{
    struct termios tio;
    int slave;
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) {
        return -1;
    }
    /* Raw before anyone reads: no echo of our own frames, no line editing of 0x00-delimited binary. */
    slave = open(ptsname(master), O_RDWR | O_NOCTTY);
    if (slave < 0 || tcgetattr(slave, &tio) != 0) {
        return -1;
    }
    /* What cfmakeraw does, spelled out: it is not POSIX. */
    tio.c_iflag &= ~(tcflag_t)(IGNBRK | BRKINT | PARMRK | ISTRIP | INLCR | IGNCR | ICRNL | IXON);
    tio.c_oflag &= ~(tcflag_t)OPOST;
    tio.c_lflag &= ~(tcflag_t)(ECHO | ECHONL | ICANON | ISIG | IEXTEN);
    tio.c_cflag &= ~(tcflag_t)(CSIZE | PARENB);
    tio.c_cflag |= CS8;
    if (tcsetattr(slave, TCSANOW, &tio) != 0) {
        return -1;
    }
    /* The slave stays open here so the pty survives the host closing and reopening it. */
    printf("PTY %s\n", ptsname(master));
    fflush(stdout);
    s->in_fd = master;
    s->out_fd = master;
    return 0;
}

static void print_vector(const char *name, const el_message *m, int last)
{
    uint8_t out[EL_MAX_ENCODED];
    char hex[2 * EL_MAX_ENCODED + 1], desc[1024];
    size_t n = 0;
    if (el_message_encode(m, out, sizeof out, &n) != EL_OK || el_describe(m, desc, sizeof desc) != 0) {
        fprintf(stderr, "vector %s does not encode\n", name);
        exit(1);
    }
    el_hex(out, n, hex);
    printf("  {\"name\": \"%s\", \"kind\": \"message\", \"seq\": %u, \"describe\": \"%s\", \"frame\": \"%s\"}%s\n",
           name, m->seq, desc, hex, last ? "" : ",");
}

static void print_stream(const char *name, const uint8_t *stream, size_t len, int last)
{
    el_decoder d;
    el_frame f;
    char hex[4096], results[512] = "";
    size_t i;
    el_rx_result r;
    el_decoder_init(&d);
    for (i = 0; i < len; i++) {
        r = el_decoder_push(&d, stream[i], &f);
        if (r != EL_RX_PENDING) {
            if (results[0] != '\0') {
                strcat(results, ",");
            }
            strcat(results, el_rx_result_name(r));
        }
    }
    el_hex(stream, len, hex);
    printf("  {\"name\": \"%s\", \"kind\": \"stream\", \"stream\": \"%s\", \"results\": \"%s\"}%s\n", name, hex,
           results, last ? "" : ",");
}

/* Frames encoded by this C code, for the Python tests to decode. */
static int print_vectors(void)
{
    el_message m;
    uint8_t chunk[EL_MAX_CHUNK], frame[EL_MAX_ENCODED], stream[1024];
    size_t i, n = 0, at;
    memset(&m, 0, sizeof m);
    printf("{\"producer\": \"edgelink-sim --vectors\", \"vectors\": [\n");
    m.type = EL_MSG_HELLO;
    m.seq = 1;
    m.u.hello.device_id = 0xA1B2C3D4u;
    m.u.hello.fw_version = FW_VERSION;
    m.u.hello.model_version = 7;
    m.u.hello.frame_width = 96;
    m.u.hello.frame_height = 64;
    m.u.hello.active_slot = 1;
    memcpy(m.u.hello.model_name, "person-int8", 11);
    print_vector("c_hello", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_DETECTION;
    m.seq = 65535;
    m.u.detection.timestamp_ms = 123456789u;
    m.u.detection.class_id = 3;
    m.u.detection.score_q16 = 52428;
    m.u.detection.box[0] = 0;
    m.u.detection.box[1] = 10;
    m.u.detection.box[2] = 95;
    m.u.detection.box[3] = 256;
    print_vector("c_detection", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_HEARTBEAT;
    m.seq = 2;
    m.u.heartbeat.uptime_ms = 60000;
    m.u.heartbeat.detections_sent = 12000;
    m.u.heartbeat.detections_dropped = 5;
    m.u.heartbeat.rx_bad_frames = 1;
    print_vector("c_heartbeat", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_LOG;
    m.seq = 3;
    m.u.log.level = 2;
    m.u.log.text_len = 14;
    memcpy(m.u.log.text, "camera\0 warm-up", 14);
    print_vector("c_log_with_zero_byte", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_OTA_BEGIN;
    m.seq = 4;
    for (i = 0; i < EL_MANIFEST_LEN; i++) {
        m.u.ota_begin.manifest[i] = (uint8_t)i;
    }
    for (i = 0; i < EL_SIGNATURE_LEN; i++) {
        m.u.ota_begin.signature[i] = (uint8_t)(255 - i);
    }
    memset(m.u.ota_begin.key_id, 0, EL_KEY_ID_LEN);
    print_vector("c_ota_begin", &m, 0);
    memset(&m, 0, sizeof m);
    for (i = 0; i < EL_MAX_CHUNK; i++) {
        chunk[i] = (uint8_t)(i * 7u); /* zero every so often: exercises COBS groups */
    }
    m.type = EL_MSG_OTA_CHUNK;
    m.seq = 5;
    m.u.ota_chunk.offset = 4096;
    m.u.ota_chunk.len = EL_MAX_CHUNK;
    m.u.ota_chunk.data = chunk;
    print_vector("c_ota_chunk_full", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_OTA_END;
    m.seq = 6;
    print_vector("c_ota_end", &m, 0);
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_ACK;
    m.seq = 7;
    m.u.ack.acked_type = EL_MSG_OTA_CHUNK;
    m.u.ack.acked_seq = 5;
    m.u.ack.value = 4096 + EL_MAX_CHUNK;
    print_vector("c_ack", &m, 0);
    m.type = EL_MSG_NACK;
    m.seq = 8;
    m.u.ack.reason = EL_NACK_BAD_OFFSET;
    print_vector("c_nack", &m, 0);
    /* A stream: garbage, a good frame, the same frame with a flipped bit, a truncated frame, a good frame. */
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_DETECTION;
    m.seq = 9;
    m.u.detection.class_id = 1;
    m.u.detection.score_q16 = 40000;
    if (el_message_encode(&m, frame, sizeof frame, &n) != EL_OK) {
        return 1;
    }
    at = 0;
    stream[at++] = 0x13;
    stream[at++] = 0x37;
    memcpy(stream + at, frame, n);
    at += n;
    memcpy(stream + at, frame, n);
    stream[at + 5] ^= 0x10;
    at += n;
    memcpy(stream + at, frame, n / 2);
    at += n / 2;
    stream[at++] = 0;
    memcpy(stream + at, frame, n);
    at += n;
    print_stream("c_stream_garbage_flip_truncate", stream, at, 0);
    memset(stream, 0x41, 300);
    stream[300] = 0;
    memcpy(stream + 301, frame, n);
    print_stream("c_stream_too_long_then_frame", stream, 301 + n, 1);
    printf("]}\n");
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: edgelink-sim --storage FILE [--key PUB]... [--pty] [--rate N] [--count N] [--baud N]\n"
                    "                    [--device-id N] [--slot-size N] [--heartbeat-ms N] [--power-cut-after N]\n"
                    "                    [--corrupt-every N]\n"
                    "       edgelink-sim --vectors\n");
}

int main(int argc, char **argv)
{
    static sim s;
    ms_key keys[MS_MAX_KEYS];
    ms_storage storage;
    size_t key_count = 0;
    const char *storage_path = NULL;
    int use_pty = 0, i;
    double rate = 0, start, next_det, next_hb, t;
    unsigned long count = 0, slot_size = 256u * 1024u, hb_ms = 1000, baud = 0;
    long cut_after = -1;
    el_decoder dec;
    el_frame f;
    el_rx_result r;
    uint8_t buf[512];
    ssize_t got;
    struct pollfd pfd;
    el_message m;
    int final_hb_sent = 0;

    memset(&s, 0, sizeof s);
    s.in_fd = 0;
    s.out_fd = 1;
    if (sodium_init() < 0) {
        return 1;
    }
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--vectors") == 0) {
            return print_vectors();
        } else if (strcmp(a, "--pty") == 0) {
            use_pty = 1;
            continue;
        }
        if (v == NULL) {
            usage();
            return 2;
        }
        i++;
        if (strcmp(a, "--storage") == 0) {
            storage_path = v;
        } else if (strcmp(a, "--key") == 0) {
            if (key_count >= MS_MAX_KEYS || load_key(v, &keys[key_count]) != 0) {
                fprintf(stderr, "edgelink-sim: --key %s: not a minisign public key (or more than %d keys)\n", v,
                        MS_MAX_KEYS);
                return 2;
            }
            key_count++;
        } else if (strcmp(a, "--rate") == 0) {
            rate = strtod(v, NULL);
        } else if (strcmp(a, "--count") == 0) {
            count = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--baud") == 0) {
            baud = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--device-id") == 0) {
            s.device_id = (uint32_t)strtoul(v, NULL, 0);
        } else if (strcmp(a, "--slot-size") == 0) {
            slot_size = strtoul(v, NULL, 0);
        } else if (strcmp(a, "--heartbeat-ms") == 0) {
            hb_ms = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--corrupt-every") == 0) {
            s.corrupt_every = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--power-cut-after") == 0) {
            cut_after = strtol(v, NULL, 10);
        } else {
            usage();
            return 2;
        }
    }
    if (storage_path == NULL || slot_size == 0 || slot_size % MS_META_SECTOR != 0 || hb_ms == 0) {
        usage();
        return 2;
    }
    if (file_storage_open(&s.fs, storage_path, ms_storage_size((uint32_t)slot_size), cut_after) != 0) {
        fprintf(stderr, "edgelink-sim: %s: cannot open storage\n", storage_path);
        return 1;
    }
    file_storage_bind(&s.fs, &storage);
    if (ms_init(&s.ms, &storage, (uint32_t)slot_size, keys, key_count) != MS_OK) {
        fprintf(stderr, "edgelink-sim: %s: cannot read model slots\n", storage_path);
        return 1;
    }
    if (s.ms.meta.trial) {
        /* Reset before the trial model was committed: it never proved itself. */
        (void)ms_rollback(&s.ms);
        power_cut_check(&s);
    }
    if (use_pty && open_pty(&s) != 0) {
        fprintf(stderr, "edgelink-sim: cannot create a pty\n");
        return 1;
    }
    (void)fcntl(s.out_fd, F_SETFL, fcntl(s.out_fd, F_GETFL) | O_NONBLOCK);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGPIPE, SIG_IGN);
    s.bytes_per_s = (double)baud / 10.0; /* 8N1: ten bit times per byte */
    start = now_s();
    s.last_refill = start;
    next_det = start;
    next_hb = start + (double)hb_ms / 1000.0;
    el_decoder_init(&dec);
    send_hello(&s);
    while (!stopping) {
        t = now_s();
        if (!s.host_ready) {
            next_det = t; /* a host opening the port flushes what was queued before: wait for its HELLO */
        }
        while (rate > 0 && s.host_ready && s.hb.detections_sent + s.hb.detections_dropped < count && t >= next_det) {
            memset(&m, 0, sizeof m);
            m.type = EL_MSG_DETECTION;
            m.u.detection.timestamp_ms = (uint32_t)((next_det - start) * 1000.0);
            m.u.detection.class_id = (uint16_t)((s.hb.detections_sent + s.hb.detections_dropped) % 3u);
            m.u.detection.score_q16 = (uint16_t)(32768u + (s.hb.detections_sent % 32768u));
            m.u.detection.box[0] = 10;
            m.u.detection.box[1] = 12;
            m.u.detection.box[2] = 50;
            m.u.detection.box[3] = 60;
            if (send_message(&s, &m, CONTROL_RESERVE) == 0) {
                s.hb.detections_sent++;
            } else {
                s.hb.detections_dropped++;
            }
            next_det += 1.0 / rate;
        }
        if (t >= next_hb) {
            send_heartbeat(&s, start);
            next_hb += (double)hb_ms / 1000.0;
        }
        if (!final_hb_sent && count > 0 && s.hb.detections_sent + s.hb.detections_dropped >= count) {
            send_heartbeat(&s, start); /* the totals, at once, so the host can account for every detection */
            final_hb_sent = 1;
        }
        flush_ring(&s);
        pfd.fd = s.in_fd;
        pfd.events = POLLIN;
        pfd.revents = 0;
        if (poll(&pfd, 1, s.used > 0 || rate > 0 ? 1 : 20) < 0 && errno != EINTR) {
            break;
        }
        if (pfd.revents & POLLIN) {
            got = read(s.in_fd, buf, sizeof buf);
            if (got == 0 && !use_pty) {
                break; /* stdin closed */
            }
            for (i = 0; i < (int)got; i++) {
                r = el_decoder_push(&dec, buf[i], &f);
                if (r == EL_RX_FRAME) {
                    handle_frame(&s, &f);
                } else if (r != EL_RX_PENDING) {
                    s.hb.rx_bad_frames++;
                }
            }
        }
    }
    flush_ring(&s);
    file_storage_close(&s.fs);
    return 0;
}
