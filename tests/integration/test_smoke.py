async def test_create_exec_destroy(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128)
    r = await sb.exec("echo hello; hostname")
    assert r.exit_code == 0
    assert r.stdout == f"hello\n{sb.id}\n"
    await sb.destroy()
